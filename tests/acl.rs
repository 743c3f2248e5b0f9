//! The rule classifier against DPDK's rte_acl: `dpuflow acl classify` and
//! `dpdk-test-acl` (Debian dpdk-dev) read the same ClassBench rules and trace, and must
//! give the same rule for every packet.

mod common;
use common::*;
use std::path::Path;

const SETS: &[&str] = &[
    "acl1_1k", "fw1_1k", "ipc1_1k", "acl1_10k", "fw1_10k", "ipc1_10k",
];

fn classbench(set: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared/classbench")
        .join(set);
    assert!(p.exists(), "ClassBench set {} missing", p.display());
    p.display().to_string()
}

#[test]
fn same_answers_as_rte_acl_on_classbench() {
    let dir = Scratch::new("acl-dpdk");
    for set in SETS {
        let rules = classbench(set);
        let trace = dir.path(&format!("{set}.trace"));
        std::fs::write(
            &trace,
            dpuflow_ok(&[
                "acl",
                "gen-trace",
                "--rules",
                &rules,
                "--count",
                "20000",
                "--seed",
                "3",
            ]),
        )
        .expect("trace");
        let ours: Vec<String> =
            dpuflow_ok(&["acl", "classify", "--rules", &rules, "--trace", &trace])
                .lines()
                .map(str::to_owned)
                .collect();
        let theirs = rte_acl_results(&rules, &trace, 20000, false);
        assert_same_rules(set, &ours, &theirs);
    }
}

/// Each trace packet's result from `dpdk-test-acl` (scalar algorithm, one pass), which
/// reports each packet as `ipv4_5tuple: N, category: 0, result: RULE` (`ipv6_5tuple` with
/// `--ipv6`).
fn rte_acl_results(rules: &str, trace: &str, count: usize, ipv6: bool) -> Vec<String> {
    let mut args = vec![
        "-l".to_owned(),
        "0".to_owned(),
        "--no-huge".to_owned(),
        "--no-pci".to_owned(),
        "-m".to_owned(),
        "512".to_owned(),
        // Tests run in parallel in one process: one DPDK runtime directory each.
        format!(
            "--file-prefix=dpuflow-test-{}-v{}",
            std::process::id(),
            if ipv6 { 6 } else { 4 }
        ),
        "--".to_owned(),
        format!("--rulesf={rules}"),
        format!("--tracef={trace}"),
        format!("--tracenum={count}"),
        "--tracestep=32".to_owned(),
        "--alg=scalar".to_owned(),
        "--iter=1".to_owned(),
    ];
    if ipv6 {
        args.push("--ipv6".to_owned());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = tool_ok("dpdk-test-acl", &args);
    let prefix = if ipv6 {
        "ipv6_5tuple: "
    } else {
        "ipv4_5tuple: "
    };
    let theirs: Vec<String> = out
        .lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .filter(|l| l.contains("category: 0,"))
        .filter_map(|l| l.rsplit_once("result: ").map(|(_, r)| r.to_owned()))
        .collect();
    assert_eq!(
        theirs.len(),
        count,
        "dpdk-test-acl printed {} results for {rules}",
        theirs.len()
    );
    theirs
}

/// Both classifiers chose the same rule for every packet.
fn assert_same_rules(set: &str, ours: &[String], theirs: &[String]) {
    let differ: Vec<usize> = (0..ours.len())
        .filter(|&i| ours[i] != theirs[i])
        .take(5)
        .collect();
    assert!(
        differ.is_empty(),
        "{set}: packets {differ:?} classified differently (ours, rte_acl): {:?}",
        differ
            .iter()
            .map(|&i| (&ours[i], &theirs[i]))
            .collect::<Vec<_>>()
    );
}

/// An IPv4 address inside 2001:db8::/32 (bits 64..96), the low 64 bits `low`, written
/// with all eight groups as dpdk-test-acl reads them.
fn embed(v4: u32, low: u64) -> String {
    let a = 0x2001_0db8_u128 << 96 | u128::from(v4) << 64 | u128::from(low);
    (0..8)
        .map(|g| format!("{:x}", (a >> (112 - 16 * g)) as u16))
        .collect::<Vec<_>>()
        .join(":")
}

/// The same rules and packets moved into IPv6 (each prefix 32 bits longer, inside
/// 2001:db8::/32; packets get varied low 64 bits no rule looks at): both classifiers must
/// still agree packet for packet.
#[test]
fn same_answers_as_rte_acl_over_ipv6() {
    let dir = Scratch::new("acl-dpdk-v6");
    for set in ["acl1_1k", "fw1_1k", "ipc1_1k"] {
        let rules4 = classbench(set);
        let net = |p: &str| {
            let (a, len) = p.trim_start_matches('@').split_once('/').expect("prefix");
            let a: std::net::Ipv4Addr = a.parse().expect("IPv4 address");
            let len: u32 = len.parse().expect("length");
            format!("{}/{}", embed(a.into(), 0), len + 32)
        };
        let rules6: String = std::fs::read_to_string(&rules4)
            .expect("rules")
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let t: Vec<&str> = l.split_whitespace().collect();
                format!("@{} {} {}\n", net(t[0]), net(t[1]), t[2..9].join(" "))
            })
            .collect();
        let rules = dir.path(&format!("{set}.rules6"));
        std::fs::write(&rules, rules6).expect("write rules");
        let trace4 = dpuflow_ok(&[
            "acl",
            "gen-trace",
            "--rules",
            &rules4,
            "--count",
            "20000",
            "--seed",
            "5",
        ]);
        let trace6: String = trace4
            .lines()
            .enumerate()
            .map(|(i, l)| {
                let t: Vec<u64> = l
                    .split_whitespace()
                    .map(|w| w.parse().expect("number"))
                    .collect();
                let low = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                format!(
                    "{} {} {} {} {}\n",
                    embed(t[0] as u32, low),
                    embed(t[1] as u32, !low),
                    t[2],
                    t[3],
                    t[4]
                )
            })
            .collect();
        let trace = dir.path(&format!("{set}.trace6"));
        std::fs::write(&trace, trace6).expect("write trace");
        let ours: Vec<String> = dpuflow_ok(&[
            "acl", "classify", "--ipv6", "--rules", &rules, "--trace", &trace,
        ])
        .lines()
        .map(str::to_owned)
        .collect();
        let theirs = rte_acl_results(&rules, &trace, 20000, true);
        assert_same_rules(set, &ours, &theirs);
    }
}

#[test]
fn gen_trace_is_deterministic() {
    let rules = classbench("fw1_1k");
    let a = dpuflow_ok(&[
        "acl",
        "gen-trace",
        "--rules",
        &rules,
        "--count",
        "500",
        "--seed",
        "9",
    ]);
    assert_eq!(
        a,
        dpuflow_ok(&[
            "acl",
            "gen-trace",
            "--rules",
            &rules,
            "--count",
            "500",
            "--seed",
            "9"
        ])
    );
    assert_ne!(
        a,
        dpuflow_ok(&[
            "acl",
            "gen-trace",
            "--rules",
            &rules,
            "--count",
            "500",
            "--seed",
            "10"
        ])
    );
    assert_eq!(a.lines().count(), 500);
}

#[test]
fn bad_rule_files_name_file_and_line() {
    let dir = Scratch::new("acl-bad");
    for (name, line2, message) in [
        ("syntax", "@1.2.3.4 nonsense", "malformed ClassBench rule"),
        (
            "inverted",
            "@1.2.3.4/32\t5.6.7.8/32\t9 : 1\t0 : 65535\t0x06/0xFF",
            "port range 9:1 is empty",
        ),
        (
            "prefix",
            "@1.2.3.4/33\t5.6.7.8/32\t0 : 65535\t0 : 65535\t0x06/0xFF",
            "prefix length 33 is out of range",
        ),
    ] {
        let path = dir.path(&format!("{name}.rules"));
        std::fs::write(
            &path,
            format!("@1.2.3.4/32\t5.6.7.8/32\t0 : 65535\t80 : 80\t0x06/0xFF\n{line2}\n"),
        )
        .expect("write");
        std::fs::write(dir.path("t"), "1 2 3 4 6\n").expect("write");
        let out = dpuflow(&[
            "acl",
            "classify",
            "--rules",
            &path,
            "--trace",
            &dir.path("t"),
        ]);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("{path}:2: {message}")), "{err}");
    }
    let out = dpuflow(&[
        "acl",
        "classify",
        "--rules",
        &classbench("acl1_1k"),
        "--trace",
        "/nonexistent",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

/// The engine's rule pipes use the classifier for large 5-tuple rule sets: replaying
/// packets built from a trace must hit exactly the rules `acl classify` names for it.
#[test]
fn engine_rule_pipes_classify_like_acl_classify() {
    let dir = Scratch::new("acl-engine");
    let rules = classbench("fw1_1k");
    let all = dpuflow_ok(&[
        "acl",
        "gen-trace",
        "--rules",
        &rules,
        "--count",
        "4000",
        "--seed",
        "5",
    ]);
    // TCP and UDP only: the engine's `l4` ports exist for them (a trace gives every packet
    // ports, a port-less packet in the engine has none).
    let trace = dir.path("t.trace");
    let tcp_udp: String = all
        .lines()
        .filter(|l| matches!(l.split_whitespace().nth(4), Some("6" | "17")))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&trace, &tcp_udp).expect("trace");
    let expected = dpuflow_ok(&["acl", "classify", "--rules", &rules, "--trace", &trace]);
    scapy(
        &dir.0,
        &format!(
            r#"
import socket, struct
pkts = []
for line in open({trace:?}):
    s, d, sp, dp, p = map(int, line.split())
    ip = IP(src=socket.inet_ntoa(struct.pack("!I", s)), dst=socket.inet_ntoa(struct.pack("!I", d)))
    pkts.append(Ether()/ip/(TCP(sport=sp, dport=dp) if p == 6 else UDP(sport=sp, dport=dp)))
wrpcap("in.pcap", pkts)
"#
        ),
    );
    let pipe = dir.path("fw.pipe");
    std::fs::write(
        &pipe,
        format!("pipeline fw\nport a {{ driver pcap }}\npipe acl root from a {{\n rules from {rules:?} {{ actions drop }}\n default {{ actions drop }}\n}}\n"),
    )
    .expect("pipe");
    let out = dpuflow_ok(&[
        "replay",
        &pipe,
        "--in",
        &format!("a={}", dir.path("in.pcap")),
        "--json",
    ]);
    let s: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let hits: Vec<u64> = s["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["packets"].as_u64().expect("n"))
        .collect();
    let mut want = vec![0u64; hits.len()];
    for line in expected.lines() {
        let i: i64 = line.parse().expect("index");
        let slot = if i < 0 { hits.len() - 1 } else { i as usize };
        want[slot] += 1;
    }
    assert!(tcp_udp.lines().count() > 1000);
    assert_eq!(hits, want);
}

/// The first live rule that matches, by scanning every rule in order: the oracle.
fn first_match(
    rules: &[Option<dpuflow::firewall::acl::Rule>],
    k: &dpuflow::firewall::acl::Key,
) -> Option<u32> {
    rules
        .iter()
        .position(|r| r.is_some_and(|r| r.matches(k)))
        .map(|i| i as u32)
}

/// Each ClassBench set, through a random sequence of deletes, re-inserts and brand-new
/// rules (enough of them to force rebuilds), answers like a linear scan over the live rules,
/// one key at a time and in batches, after every stretch of updates.
#[test]
fn classbench_sets_agree_with_a_scan_through_updates() {
    use dpuflow::firewall::acl::{gen_trace, load_rules, Classifier, SplitMix};
    for (n, set) in SETS.iter().enumerate() {
        let rules = load_rules(Path::new(&classbench(set))).expect("rules");
        let trace = gen_trace(&rules, 3000, n as u64 + 1);
        let c = Classifier::new(&rules);
        let mut live: Vec<Option<_>> = rules.iter().copied().map(Some).collect();
        let mut rng = SplitMix(n as u64 + 100);
        let mut out = vec![None; trace.len()];
        for round in 0..4 {
            for _ in 0..300 {
                let id = (rng.next_u64() % rules.len() as u64) as usize;
                match rng.next_u64() % 10 {
                    0..=3 => {
                        c.remove(id as u32);
                        live[id] = None;
                    }
                    4..=7 => {
                        c.insert(id as u32, rules[id]);
                        live[id] = Some(rules[id]);
                    }
                    _ => {
                        // A rule new to the classifier: another rule's ranges at a new
                        // priority, between existing ones or after them all.
                        let new_id = (rng.next_u64() % (live.len() as u64 + 40)) as usize;
                        if new_id >= live.len() {
                            live.resize(new_id + 1, None);
                        }
                        c.insert(new_id as u32, rules[id]);
                        live[new_id] = Some(rules[id]);
                    }
                }
            }
            c.classify_batch(&trace, &mut out);
            for (k, got) in trace.iter().zip(&out) {
                let want = first_match(&live, k);
                assert_eq!(*got, want, "{set}, round {round}, batched, key {k:?}");
                assert_eq!(c.classify(k), want, "{set}, round {round}, one key {k:?}");
            }
        }
    }
}
