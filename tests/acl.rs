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
        let out = tool_ok(
            "dpdk-test-acl",
            &[
                "-l",
                "0",
                "--no-huge",
                "--no-pci",
                "-m",
                "512",
                &format!("--file-prefix=dpuflow-test-{}", std::process::id()),
                "--",
                &format!("--rulesf={rules}"),
                &format!("--tracef={trace}"),
                "--tracenum=20000",
                "--tracestep=32",
                "--alg=scalar",
                "--iter=1",
            ],
        );
        // dpdk-test-acl reports each packet as `ipv4_5tuple: N, category: 0, result: RULE`.
        let theirs: Vec<String> = out
            .lines()
            .filter_map(|l| l.strip_prefix("ipv4_5tuple: "))
            .filter(|l| l.contains("category: 0,"))
            .filter_map(|l| l.rsplit_once("result: ").map(|(_, r)| r.to_owned()))
            .collect();
        assert_eq!(
            theirs.len(),
            20000,
            "{set}: dpdk-test-acl printed {} results",
            theirs.len()
        );
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
