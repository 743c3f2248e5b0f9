//! The command line as a user runs it: exit codes, output formats, Graphviz on the `graph`
//! output, the DOCA plan's verdict.

mod common;
use common::{dpuflow, dpuflow_command, dpuflow_ok, tshark_fields, Scratch};
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// Runs dpuflow and asserts it exits 2 (a usage error) saying `says` on stderr.
fn assert_usage_error(args: &[&str], says: &str) {
    let out = dpuflow(args);
    assert_eq!(out.status.code(), Some(2), "{args:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(says), "{args:?}: {err}");
}

fn examples() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("pipelines")
        .expect("pipelines/")
        .map(|e| e.expect("entry").path().display().to_string())
        .filter(|p| p.ends_with(".pipe"))
        .collect();
    v.sort();
    v
}

#[test]
fn check_accepts_every_example() {
    let files = examples();
    assert!(files.len() >= 4);
    let args: Vec<&str> = std::iter::once("check")
        .chain(files.iter().map(String::as_str))
        .collect();
    let out = dpuflow(&args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stderr.is_empty(),
        "examples must have no warnings: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(": ok: "))
            .count(),
        files.len()
    );
}

/// Numeric flags out of their range are usage errors (exit 2), not failures later: a rate
/// of 0 packets a second once panicked the service's reader.
#[test]
fn numeric_flags_out_of_range_are_usage_errors() {
    for args in [
        &["run", "pipelines/vxlan-gateway.pipe", "--rate", "0"][..],
        &["run", "pipelines/vxlan-gateway.pipe", "--batch", "0"],
        &[
            "run",
            "pipelines/vxlan-gateway.pipe",
            "--ipfix-sampling",
            "0",
        ],
        &["bench", "pipelines/vxlan-gateway.pipe", "--batch", "2000"],
        &["bench", "pipelines/vxlan-gateway.pipe", "--packets", "0"],
        &["bench", "pipelines/vxlan-gateway.pipe", "--flows", "0"],
        &["run", "pipelines/vxlan-gateway.pipe", "--workers", "0"],
        &["bench", "pipelines/vxlan-gateway.pipe", "--size", "9217"],
    ] {
        assert_usage_error(args, "invalid value");
    }
}

/// `bench --rule NAME` makes every flow for that rule of the root pipe: the capture it
/// writes for the firewall's `dns` rule holds DNS queries only, one a flow; a rule the
/// root pipe does not have is a usage error.
#[test]
fn bench_aims_every_flow_at_one_rule() {
    let dir = Scratch::new("bench-rule");
    let pcap = dir.path("dns.pcap");
    let firewall = [
        "bench",
        "pipelines/stateful-firewall.pipe",
        "--port",
        "inside",
    ];
    let aimed = ["--rule", "dns", "--flows", "16", "--write", &pcap];
    dpuflow_ok(&[&firewall[..], &aimed[..]].concat());
    assert_eq!(tshark_fields(&pcap, &["udp.dstport"]), vec!["53"; 16]);
    let astray = [&firewall[..], &["--rule", "nope"][..]].concat();
    assert_usage_error(&astray, "has no rule `nope`");
}

/// A collector's name that does not resolve, or is not a name, stops `run` at once.
#[test]
fn bad_collectors_are_refused_at_start() {
    let run = |collector| ["run", "pipelines/vxlan-gateway.pipe", "--ipfix", collector];
    // RFC 2606: .invalid never resolves.
    let unresolved = run("no-such-collector.invalid:4739");
    assert_usage_error(&unresolved, "cannot resolve the IPFIX collector");
    assert_usage_error(&unresolved, "no-such-collector.invalid:4739");
    for bad in [
        "under_score:4739",
        "collector",
        "collector:65536",
        "x-.example:1",
        // Nothing can be sent to port 0: the export went nowhere, saying nothing.
        "127.0.0.1:0",
    ] {
        assert_usage_error(&run(bad), "invalid value");
    }
}

/// A capture named as both an input and an output would be emptied before it is read, one
/// output for two ports would be a broken capture, and of two outputs for one port only one
/// would be written: `replay` and `run` refuse them and touch nothing.
#[test]
fn captures_that_would_lose_data_are_refused() {
    let dir = std::env::temp_dir().join(format!("dpuflow-cli-bind-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let capture = dir.join("host.pcap");
    std::fs::copy("pipelines/captures/host.pcap", &capture).expect("copy");
    let before = std::fs::read(&capture).expect("read");
    let input = format!("host={}", capture.display());
    let fresh = dir.join("out.pcap");
    let same_as_input = format!("uplink={}", capture.display());
    let same_by_another_path = format!("uplink={}/./host.pcap", dir.display());
    let first_output = format!("uplink={}", fresh.display());
    let second_output = format!("host={}/./out.pcap", dir.display());
    let third_output = format!("uplink={}", dir.join("other.pcap").display());
    let cases = [
        (
            vec![
                "replay",
                "pipelines/vxlan-gateway.pipe",
                "--in",
                &input,
                "--out",
                &same_as_input,
            ],
            "is both an input and an output",
        ),
        (
            vec![
                "run",
                "pipelines/vxlan-gateway.pipe",
                "--in",
                &input,
                "--out",
                &same_by_another_path,
            ],
            "is both an input and an output",
        ),
        (
            vec![
                "replay",
                "pipelines/vxlan-gateway.pipe",
                "--in",
                &input,
                "--out",
                &first_output,
                "--out",
                &second_output,
            ],
            "is the output of two ports",
        ),
        (
            vec![
                "replay",
                "pipelines/vxlan-gateway.pipe",
                "--in",
                &input,
                "--out",
                &first_output,
                "--out",
                &third_output,
            ],
            "port `uplink` has two outputs",
        ),
    ];
    for (args, why) in &cases {
        assert_usage_error(args, why);
    }
    assert_eq!(
        std::fs::read(&capture).expect("read"),
        before,
        "the input was touched"
    );
    assert!(!fresh.exists(), "an output was written");
    assert!(!dir.join("other.pcap").exists(), "an output was written");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn check_exit_codes() {
    assert_eq!(
        dpuflow(&["check", "tests/bad/unreachable-pipe.pipe"])
            .status
            .code(),
        Some(0),
        "warnings only"
    );
    assert_eq!(
        dpuflow(&["check", "tests/bad/no-default.pipe"])
            .status
            .code(),
        Some(1)
    );
    assert_eq!(
        dpuflow(&[
            "check",
            "pipelines/vxlan-gateway.pipe",
            "tests/bad/no-default.pipe"
        ])
        .status
        .code(),
        Some(1)
    );
    assert_eq!(
        dpuflow(&["check", "tests/no-such-file.pipe"]).status.code(),
        Some(2)
    );
    assert_eq!(dpuflow(&["check"]).status.code(), Some(2), "usage error");
    assert_eq!(
        dpuflow(&["check", "--format", "yaml", "x.pipe"])
            .status
            .code(),
        Some(2)
    );
}

#[test]
fn check_json_lines() {
    let out = dpuflow(&[
        "check",
        "--format",
        "json",
        "tests/bad/undefined-names.pipe",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 6);
    assert_eq!(
        lines[0],
        serde_json::json!({
            "file": "tests/bad/undefined-names.pipe",
            "line": 8,
            "col": 24,
            "severity": "error",
            "message": "undefined port `hots`",
            "hint": "did you mean `host`?"
        })
    );
    assert_eq!(lines[5]["severity"], "warning");
}

#[test]
fn graph_renders_with_graphviz() {
    for file in examples() {
        let out = dpuflow(&["graph", &file]);
        assert!(
            out.status.success(),
            "{file}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let dot = String::from_utf8(out.stdout).expect("utf-8");
        renders(&dot, &file);
    }
}

/// Graphviz draws `dot` (the graph of `file`) without an error or a warning.
fn renders(dot: &str, file: &str) {
    assert!(dot.starts_with("digraph "));
    let mut child = Command::new("dot")
        .arg("-Tsvg")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect(
            "Graphviz `dot` must be installed (Debian package graphviz; scripts/test installs it)",
        );
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(dot.as_bytes())
        .expect("write");
    let svg = child.wait_with_output().expect("dot");
    assert!(
        svg.status.success(),
        "{file}: dot rejected the graph: {}",
        String::from_utf8_lossy(&svg.stderr)
    );
    assert!(
        svg.stderr.is_empty(),
        "{file}: dot warned: {}",
        String::from_utf8_lossy(&svg.stderr)
    );
    let svg = String::from_utf8(svg.stdout).expect("utf-8");
    assert!(svg.contains("<svg"));
}

/// `plan --hardware-only` lets a deployment insist on a pipeline the NIC runs whole.
#[test]
fn plan_says_when_a_pipe_would_run_in_software() {
    let out = dpuflow(&["plan", "--hardware-only", "pipelines/kv-offload.pipe"]);
    assert_eq!(out.status.code(), Some(0));
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(
        plan.contains("0 pipeline pipes and 0 rules in software"),
        "{plan}"
    );
    // The gateway answers ARP for its tunnel endpoint on the Arm cores.
    let out = dpuflow(&["plan", "--hardware-only", "pipelines/vxlan-gateway.pipe"]);
    assert_eq!(out.status.code(), Some(3));
    let out = dpuflow(&[
        "plan",
        "--hardware-only",
        "pipelines/stateful-firewall.pipe",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("1 of its pipes and 4 of its rules would run in software"),
        "{err}"
    );
    // Without the flag, a plan with pipes in software is still a plan.
    assert_eq!(
        dpuflow(&["plan", "pipelines/stateful-firewall.pipe"])
            .status
            .code(),
        Some(0)
    );
}

/// `plan --calls` prints the installation's calls, the same as its golden file.
#[test]
fn plan_calls_list_what_installing_hands_doca_flow() {
    let out = dpuflow(&["plan", "--calls", "pipelines/vxlan-gateway.pipe"]);
    assert_eq!(out.status.code(), Some(0));
    let golden = std::fs::read_to_string("tests/data/plans/vxlan-gateway.calls").expect("golden");
    assert_eq!(String::from_utf8_lossy(&out.stdout), golden);
}

/// A table too big to draw entry by entry is one node, with an edge to each place its
/// entries send packets, once.
#[test]
fn graph_draws_a_large_table_as_one_node() {
    let dir = Scratch::new("cli-graph");
    let file = dir.path("big.pipe");
    let entries: String = (0..100)
        .map(|i| format!("        10.0.{i}.1 => fwd {}\n", ["a", "b"][i % 2]))
        .collect();
    std::fs::write(
        &file,
        format!(
            "pipeline big\nport a {{ driver pcap }}\nport b {{ driver pcap }}\n\
             pipe p root from a {{\n    table exact ipv4.dst {{\n{entries}    }}\n\
             \x20   default {{ actions drop }}\n}}\n"
        ),
    )
    .expect("write");
    let out = dpuflow(&["graph", &file]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dot = String::from_utf8(out.stdout).expect("utf-8");
    assert!(
        dot.contains("[shape=box3d, label=\"100 entries\"]"),
        "{dot}"
    );
    for port in ["a", "b"] {
        let edge = format!("\"pipe:p/entries\" -> \"port:{port}\" [label=\"fwd\"]");
        assert_eq!(dot.matches(&edge).count(), 1, "{edge} in\n{dot}");
    }
    renders(&dot, &file);
}

#[test]
fn graph_shows_ports_pipes_and_edges() {
    let out = dpuflow(&["graph", "pipelines/kv-offload.pipe"]);
    let dot = String::from_utf8(out.stdout).expect("utf-8");
    for needle in [
        "\"port:host\" -> \"pipe:from_host\"",
        "\"pipe:from_fabric/rule:kv\" -> \"service:kvcache\" [label=\"to\"]",
        "\"pipe:from_fabric/rule:vni100\" -> \"port:host\" [label=\"fwd\"]",
        "\"pipe:from_host/10.1.0.0/16\" -> \"port:fabric\" [label=\"fwd\"]",
    ] {
        assert!(dot.contains(needle), "missing {needle} in\n{dot}");
    }
}

#[test]
fn graph_of_invalid_file_fails() {
    let out = dpuflow(&["graph", "tests/bad/goto-cycle.pipe"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
}

#[test]
fn every_subcommand_has_help_with_an_example() {
    for sub in [
        "check",
        "graph",
        "plan",
        "replay",
        "trace",
        "run",
        "bench",
        "acl classify",
        "acl bench",
        "acl gen-trace",
        "kv inspect",
    ] {
        let mut args: Vec<&str> = sub.split(' ').collect();
        args.push("--help");
        let out = dpuflow(&args);
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("Example:") && text.contains(&format!("dpuflow {sub} ")),
            "{sub} --help:\n{text}"
        );
    }
    assert!(Path::new(env!("CARGO_BIN_EXE_dpuflow")).exists());
}

/// A reader that stops early (`| head`) ends the command quietly, by SIGPIPE as other
/// command-line tools end, not with a panic about a failed write.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let rules = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/classbench/acl1_1k");
    let mut child = dpuflow_command()
        .args(["acl", "gen-trace", "--rules", rules, "--count", "1000000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dpuflow");
    let mut first = [0u8; 64];
    child
        .stdout
        .as_mut()
        .expect("stdout")
        .read_exact(&mut first)
        .expect("first line");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.is_empty(), "stderr: {stderr}");
    assert_eq!(out.status.signal(), Some(libc::SIGPIPE), "{:?}", out.status);
}

/// `run` opens af_packet and af_xdp ports live (tests/live_ports.rs), not doca ones: with
/// no capture to read and no port it can open, it refuses to start (it would serve metrics
/// of no traffic, looking healthy) and names the ports. A live port on a missing
/// interface stops it at once. Replaying captures, it leaves the live ports bound to none
/// closed and names each.
#[test]
fn ports_left_unopened_are_said() {
    let dir = Scratch::new("cli-doca");
    let doca = dir.path("doca.pipe");
    std::fs::write(
        &doca,
        "pipeline hw\n\
         port host   { driver doca  iface \"pf0hpf\" }\n\
         port uplink { driver doca  iface \"p0\" }\n\
         pipe p root from host { default { actions fwd uplink } }\n",
    )
    .expect("write");
    assert_usage_error(
        &["run", &doca],
        "no input: bind a port to a capture file with --in PORT=FILE (or its pipeline `file`); \
         port host uses driver doca (iface pf0hpf), which only the DOCA backend opens (not in \
         this build: `dpuflow plan` shows what it would program); port uplink uses driver doca \
         (iface p0), which only the DOCA backend opens (not in this build: `dpuflow plan` shows \
         what it would program)",
    );
    assert_usage_error(
        &["run", "pipelines/stateful-firewall.pipe"],
        "interface pf0hpf: No such device",
    );
    assert_usage_error(
        &["run", "pipelines/vxlan-gateway.pipe"],
        "interface pf0hpf: No such device",
    );
    let mut child = dpuflow_command()
        .args([
            "run",
            "pipelines/vxlan-gateway.pipe",
            "--in",
            "host=pipelines/captures/host.pcap",
            "--metrics",
            "127.0.0.1:0",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dpuflow run");
    let mut log = std::io::BufReader::new(child.stderr.take().expect("stderr"));
    let mut seen = String::new();
    while !seen.contains("running") {
        let mut line = String::new();
        let n = std::io::BufRead::read_line(&mut log, &mut line).expect("log");
        assert!(n > 0, "dpuflow run ended early: {seen}");
        seen.push_str(&line);
    }
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill(1)");
    assert!(term.success());
    assert!(child.wait().expect("wait").success());
    assert!(
        seen.contains(
            "port uplink uses driver af_xdp (iface p0), not opened while the service replays \
             captures: it is neither read nor written"
        ),
        "{seen}"
    );
    assert!(!seen.contains("port host uses"), "{seen}");
}

/// `--loop` and `--rate` replay captures and say so when given live ports. (Opens an
/// AF_PACKET socket on `lo`: root.)
#[test]
fn loop_and_rate_are_for_captures() {
    let dir = Scratch::new("cli-live");
    let pipe = dir.path("live.pipe");
    std::fs::write(
        &pipe,
        "pipeline live\n\
         port live { driver af_packet  iface \"lo\" }\n\
         port file { driver pcap }\n\
         pipe p root from live, file { default { actions drop } }\n",
    )
    .expect("write");
    for flag in [&["--loop"][..], &["--rate", "1000"]] {
        let mut args = vec!["run", pipe.as_str()];
        args.extend_from_slice(flag);
        assert_usage_error(&args, "--loop and --rate replay captures");
    }
    // A user who may not open the port hears the same, not that the socket was refused:
    // the flags are checked before any port is opened. As root, as nobody without
    // capabilities (setpriv, util-linux).
    let mut unprivileged = dpuflow_command();
    if running_as_root() {
        let dpuflow = unprivileged;
        unprivileged = Command::new("setpriv");
        unprivileged
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args(["--inh-caps=-all", "--bounding-set=-all"])
            .arg(dpuflow.get_program())
            .args(dpuflow.get_args());
    }
    let out = unprivileged
        .args(["run", &pipe, "--loop"])
        .output()
        .expect("run dpuflow (as root through setpriv, util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--loop and --rate replay captures"), "{err}");
}

/// `--busy-poll` polls live ports: a service that replays captures has none, and is told
/// so rather than left spinning on a capture's reads.
#[test]
fn busy_polling_is_for_live_ports() {
    let dir = Scratch::new("cli-busy-poll");
    let capture = dir.path("host.pcap");
    let written = dpuflow(&[
        "bench",
        "pipelines/vxlan-gateway.pipe",
        "--flows",
        "4",
        "--write",
        &capture,
    ]);
    assert!(written.status.success(), "{written:?}");
    let input = format!("host={capture}");
    let args = [
        "run",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &input,
        "--busy-poll",
    ];
    assert_usage_error(
        &args,
        "--busy-poll polls live ports, and the service has none",
    );
}

/// Whether the tests run as root (the effective user of /proc/self).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|u| u.split_whitespace().nth(1).map(|e| e == "0"))
        })
        .unwrap_or(false)
}
