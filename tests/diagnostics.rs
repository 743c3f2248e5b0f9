//! Golden-file tests for diagnostics: each `tests/bad/NAME.pipe` is checked and its
//! rendered diagnostics must equal `tests/bad/NAME.stderr` exactly.
//!
//! After an intended change of wording, regenerate with `DPUFLOW_BLESS=1 cargo test --test
//! diagnostics` and review the diff.

use dpuflow::lang;
use std::path::Path;

#[test]
fn bad_files_give_exact_diagnostics() {
    let bless = std::env::var_os("DPUFLOW_BLESS").is_some();
    let mut files: Vec<_> = std::fs::read_dir("tests/bad")
        .expect("tests/bad exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "pipe"))
        .collect();
    files.sort();
    assert!(
        files.len() >= 10,
        "expected the bad-file corpus, found {files:?}"
    );
    let mut failures = Vec::new();
    for pipe in files {
        let checked = lang::check_file(&pipe).expect("readable");
        let actual = checked.render();
        let golden = pipe.with_extension("stderr");
        if bless {
            std::fs::write(&golden, &actual).expect("write golden file");
            continue;
        }
        let expected = std::fs::read_to_string(&golden)
            .unwrap_or_else(|_| panic!("missing {}", golden.display()));
        if actual != expected {
            failures.push(format!("--- {}\n{actual}", golden.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "diagnostics differ from the golden files:\n{}",
        failures.join("\n")
    );
}

/// The checks each bad file exists for: a file must keep producing its diagnostic.
#[test]
fn every_semantic_check_has_a_bad_file() {
    let expect = [
        ("undefined-names", "error: undefined port `hots`"),
        ("undefined-names", "error: undefined pipe `overlya`"),
        ("undefined-names", "error: undefined meter `dns_limt`"),
        ("undefined-names", "error: undefined service `kvcache`"),
        ("duplicate-names", "error: duplicate port `host`"),
        (
            "bad-blocks",
            "error: `nvme_digest` is none, header, data or both, not `crc`",
        ),
        (
            "bad-blocks",
            "error: `nvme_digest` applies to nvme-tcp:// targets only",
        ),
        (
            "bad-blocks",
            "error: `page_cache` applies to local targets only",
        ),
        (
            "bad-blocks",
            "error: `page_cache` is `on` or `off`, not `sometimes`",
        ),
        ("bad-blocks", "error: `discard` is `on` or `off`, not `always`"),
        (
            "bad-blocks",
            "error: `cluster_leaving` is `on` or `off`, not `maybe`",
        ),
        (
            "bad-blocks",
            "error: a node leaving a cluster needs the `cluster_node`s it hands its keys to",
        ),
        (
            "bad-blocks",
            "error: `listen` 10.0.0.3:6379 is among the `cluster_node`s of a node leaving the cluster",
        ),
        ("bad-blocks", "error: `io_timeout` is at least 100ms, not 10ms"),
        ("bad-blocks", "error: `max_clients` is 1 to 16384, not 20000"),
        ("bad-blocks", "error: invalid slow log threshold `fast`"),
        (
            "bad-blocks",
            "error: `io_timeout` applies to nvme-tcp:// and nbd:// targets only",
        ),
        (
            "bad-blocks",
            "error: target `nvme-tcp://192.0.2.20:4420/nqn.2026-11.io.example:kv0` is given twice",
        ),
        (
            "bad-blocks",
            "error: `stripe` is a whole number of blocks (65536 bytes each), from one to 65535, not 102400 bytes",
        ),
        (
            "bad-blocks",
            "error: `nvme_digest` applies to nvme-tcp:// targets only",
        ),
        (
            "bad-blocks",
            "error: cluster node `10.0.0.1:6379` is given twice",
        ),
        ("bad-blocks", "error: invalid cluster node address `everywhere`"),
        (
            "bad-blocks",
            "error: `listen` 127.0.0.1:6384 is not among the `cluster_node`s",
        ),
        ("duplicate-names", "error: duplicate rule `a`"),
        ("duplicate-names", "error: duplicate pipe `ingress`"),
        (
            "duplicate-table-keys",
            "error: duplicate table key `10.0.0.0/8`",
        ),
        ("duplicate-table-keys", "21:9: error: duplicate table key\n"),
        ("duplicate-table-keys", "23:9: error: duplicate table key\n"),
        (
            "duplicate-names",
            "error: services `kv_a` and `kv_b` store on the same target",
        ),
        (
            "goto-cycle",
            "error: `goto` cycle: classify -> police -> classify",
        ),
        (
            "unreachable-pipe",
            "warning: pipe `orphan` is not reached from any root pipe",
        ),
        ("no-default", "error: pipe `ingress` has no `default`"),
        (
            "out-of-range",
            "error: value 65536 is out of range for `tcp.dst` (0-65535)",
        ),
        (
            "out-of-range",
            "error: prefix length 33 is out of range for an IPv4 address (0-32)",
        ),
        (
            "out-of-range",
            "error: prefix length 129 is out of range for an IPv6 address (0-128)",
        ),
        (
            "out-of-range",
            "error: VNI 16777216 is out of range for `vxlan.vni` (0-16777215)",
        ),
        (
            "out-of-range",
            "error: DSCP 64 is out of range for `ip.dscp` (0-63)",
        ),
        (
            "out-of-range",
            "error: range `2000-1000` of `udp.dst` is empty",
        ),
        (
            "out-of-range",
            "error: `ipv4.dst` takes an IPv4 address, found IPv6 `2001:db8::1`",
        ),
        (
            "conflicting-actions",
            "error: conflicting terminal actions: `drop` after `fwd`",
        ),
        (
            "conflicting-actions",
            "error: `vxlan.encap` without a forward",
        ),
        (
            "conflicting-actions",
            "error: `geneve.decap` of a tunnel this rule does not match",
        ),
        (
            "shadowed-rule",
            "warning: rule `ssh` is never used: rule `internal` before it",
        ),
        ("misspelled", "hint: did you mean `ipv4.dst`?"),
        ("misspelled", "hint: did you mean `fwd`?"),
        (
            "rules-missing",
            "error: cannot read rule file `no-such-file.rules`",
        ),
        (
            "rules-malformed",
            "malformed.rules:4:1: error: malformed ClassBench rule",
        ),
        ("bad-settings", "error: `rate` must be above zero"),
        ("bad-settings", "error: invalid burst `lots`"),
        (
            "bad-settings",
            "error: `peak` and `rate` must both be packet rates or both bit rates",
        ),
        (
            "bad-settings",
            "error: `excess_burst` belongs to single-rate meters",
        ),
        ("bad-settings", "error: `peak_burst` without `peak`"),
        ("bad-settings", "= hint: e.g. `timeout tcp_established 5d`"),
        ("bad-settings", "error: unknown conntrack state `tcp_estab`"),
        ("bad-settings", "error: `flow_cache` is 1 to 67108864 flows"),
        ("bad-settings", "error: `idle_timeout` must be above zero"),
        ("bad-actions", "error: cannot decrement `tos`"),
        ("bad-actions", "error: `eth.type` cannot be set"),
        (
            "bad-actions",
            "error: `ipv4.dst` takes a single address here, not a prefix",
        ),
        ("bad-actions", "error: `vlan.push` needs an `id`"),
        ("bad-actions", "error: zone 70000 is out of range (0-65535)"),
        (
            "bad-actions",
            "error: invalid MAC address `02:00:00:00:01` for `arp.reply`",
        ),
        (
            "unanswerable",
            "warning: `arp.reply` in a rule that does not match `arp.op 1`",
        ),
        (
            "bad-actions",
            "error: outer `src` and `dst` are of different IP versions",
        ),
        ("bad-actions", "error: VXLAN has no options"),
        ("bad-actions", "= hint: e.g. `option 0x0102 0x80 0x0000000a`"),
        (
            "bad-actions",
            "error: option data is 2 bytes; it must be a multiple of 4, at most 124",
        ),
        ("bad-matches", "error: `vxlan.vni` has no inner copy"),
        ("bad-matches", "= hint: write `vxlan.vni`"),
        ("bad-matches", "= hint: values are never negative"),
        (
            "bad-matches",
            "error: invalid IPv6 address `2001:db8::zz` for `ipv6.dst`",
        ),
        ("bad-matches", "error: invalid TCP flags `syn+fun`"),
        (
            "bad-matches",
            "error: TCP flags `syn+ack/syn` set bits outside the mask",
        ),
    ];
    for (file, needle) in expect {
        let checked =
            lang::check_file(Path::new(&format!("tests/bad/{file}.pipe"))).expect("readable");
        let text = checked.render();
        assert!(
            text.contains(needle),
            "{file}.pipe: expected `{needle}` in:\n{text}"
        );
    }
}
