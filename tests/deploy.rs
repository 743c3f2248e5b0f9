//! The deployment files stay true to the code: every metric the Grafana dashboard and the
//! alerting rules query exists, the rules pass promtool's checks and unit tests, and the
//! systemd unit and the Kubernetes static pod run commands the binary has.

mod common;
use common::dpuflow_command;
use dpuflow::ir::{KvCache, StorageTarget};
use dpuflow::kvcache::server::KvService;
use dpuflow::lang;
use dpuflow::telemetry::metrics::{render, render_kv, Info, ServiceState, ThreadTimes};
use dpuflow::telemetry::{CollectorStats, ExportStats, Snapshot};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The exposition of a pipeline with everything that has metrics.
fn full_exposition() -> String {
    // A pipeline with everything that has metrics: ports, rules, a meter, conntrack; the
    // flow cache of IPFIX export.
    let text = "pipeline all\nport a { driver pcap }\nport b { driver pcap }\nmeter m { rate 100 pps }\n\
                pipe p root from a { rule r { actions meter m, ct.commit, fwd b } default { actions drop } }\n";
    let program = lang::check_source("all.pipe", text, Path::new("."))
        .program
        .expect("valid");
    let info = Info {
        version: "test".into(),
        backend: "software",
        conntrack_limit: Some(10),
        flow_limit: Some(10),
    };
    // And a KV-cache service, on a file target.
    let target = std::env::temp_dir().join(format!("dpuflow-deploy-kv-{}", std::process::id()));
    let kv = KvService::start(
        "kvcache",
        &KvCache {
            listen: "127.0.0.1:0".parse().expect("addr"),
            targets: vec![StorageTarget::Local {
                path: target.clone(),
            }],
            capacity: 1 << 20,
            block_size: 65536,
            stripe: 1 << 20,
            connections: 1,
            inline_max: 0,
            checkpoint: None,
            nvme_digests: Default::default(),
            page_cache: None,
            discard: false,
            io_timeout: std::time::Duration::from_secs(30),
            max_clients: dpuflow::ir::DEFAULT_MAX_CLIENTS,
            slowlog: Some(dpuflow::ir::DEFAULT_SLOWLOG),
            password_file: None,
            tls: None,
            cluster: Vec::new(),
            cluster_leaving: false,
        },
        Arc::new(AtomicBool::new(false)),
    )
    .expect("kvcache");
    let one_worker = ServiceState {
        threads: vec![ThreadTimes {
            name: "worker-0".into(),
            ..ThreadTimes::default()
        }],
        process: Some(Default::default()),
        // Over TLS, with basic auth.
        endpoint_tls_failures: Some(0),
        endpoint_auth_failures: Some(0),
        ..ServiceState::default()
    };
    // Exporting to one collector.
    let exporting = Snapshot {
        export: Some(ExportStats {
            collectors: vec![CollectorStats {
                collector: "127.0.0.1:4739".into(),
                ..CollectorStats::default()
            }],
            paced_ns: 0,
        }),
        ..Snapshot::default()
    };
    let exposition = render(&program, &exporting, &info, &one_worker) + &render_kv(&[kv]);
    std::fs::remove_file(target).expect("remove target");
    exposition
}

/// The metrics a PromQL expression names: dpuflow's own and the process's.
fn metrics_in(expr: &str) -> Vec<String> {
    let mut used = Vec::new();
    let mut rest = expr;
    let next = |rest: &str| {
        ["dpuflow_", "process_"]
            .iter()
            .filter_map(|p| rest.find(p))
            .min()
    };
    while let Some(at) = next(rest) {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        used.push(name);
    }
    used
}

/// Fails naming `what` when `exposition` has no series of a metric in `used`.
fn assert_exported(exposition: &str, used: &[String], what: &str) {
    for name in used {
        assert!(
            exposition
                .lines()
                .any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))),
            "{what} queries {name}, which dpuflow does not export"
        );
    }
}

#[test]
fn every_metric_the_dashboard_queries_exists() {
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("deploy/grafana/dpuflow.json").expect("dashboard"),
    )
    .expect("JSON");
    let mut used = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            used.extend(metrics_in(target["expr"].as_str().expect("expr")));
        }
    }
    assert!(used.len() >= 10, "{used:?}");
    assert_exported(&full_exposition(), &used, "the dashboard");
}

/// The alerting rules load in Prometheus (`promtool check rules`), fire when and only
/// when their unit tests say (`promtool test rules`), and query metrics that exist.
#[test]
fn alerting_rules_pass_promtool_and_query_existing_metrics() {
    let dir = "deploy/prometheus";
    for args in [
        ["check", "rules", "dpuflow-rules.yml"],
        ["test", "rules", "dpuflow-rules.test.yml"],
    ] {
        let out = std::process::Command::new("promtool")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("promtool is required (Debian package prometheus; scripts/test installs it)");
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let rules = std::fs::read_to_string(format!("{dir}/dpuflow-rules.yml")).expect("rules");
    let used: Vec<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("expr:"))
        .flat_map(metrics_in)
        .collect();
    assert!(used.len() >= 8, "{used:?}");
    assert_exported(&full_exposition(), &used, "an alerting rule");
}

#[test]
fn systemd_unit_runs_existing_commands() {
    let unit = std::fs::read_to_string("deploy/systemd/dpuflow.service").expect("unit");
    let runs_dpuflow = |l: &&str| l.starts_with("Exec") && l.contains("/dpuflow ");
    for line in unit.lines().filter(runs_dpuflow) {
        let args: Vec<&str> = line
            .split_once('=')
            .expect("=")
            .1
            .split_whitespace()
            .skip(1)
            .collect();
        let sub = args[0];
        let out = dpuflow_command()
            .args([sub, "--help"])
            .output()
            .expect("run");
        assert!(out.status.success(), "`dpuflow {sub}` does not exist");
        for flag in args.iter().filter(|a| a.starts_with("--")) {
            assert!(
                String::from_utf8_lossy(&out.stdout).contains(*flag),
                "`dpuflow {sub}` has no {flag}"
            );
        }
    }
    assert!(unit.contains("NoNewPrivileges=yes") && unit.contains("CapabilityBoundingSet="));
}

/// systemd reads the unit without a complaint (`systemd-analyze verify`, which names
/// what it cannot parse and otherwise ignores), with the binary's path this build's.
#[test]
fn systemd_reads_the_unit_without_a_complaint() {
    let dir = common::Scratch::new("deploy-unit");
    let unit = std::fs::read_to_string("deploy/systemd/dpuflow.service").expect("unit");
    let path = dir.path("dpuflow.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/dpuflow", env!("CARGO_BIN_EXE_dpuflow")),
    )
    .expect("write unit");
    let out = common::tool("systemd-analyze", &["verify", &path]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && said.is_empty(), "{said}");
    assert!(unit.contains("Type=notify\n") && unit.contains("WatchdogSec="));
}

/// The manifest as JSON, read by a YAML parser (python3-yaml).
fn manifest(path: &str) -> serde_json::Value {
    let out = std::process::Command::new("/usr/bin/python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
            path,
        ])
        .output()
        .expect("/usr/bin/python3 with python3-yaml is required (scripts/test installs it)");
    assert!(
        out.status.success(),
        "{path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// `dpuflow SUB --help`, failing the test unless SUB exists.
fn help(sub: &str) -> String {
    let out = dpuflow_command()
        .args([sub, "--help"])
        .output()
        .expect("run");
    assert!(out.status.success(), "`dpuflow {sub}` does not exist");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn kubernetes_pod_runs_existing_commands_and_probes_its_endpoint() {
    let pod = manifest("deploy/kubernetes/dpuflow-pod.yaml");
    assert_eq!(pod["kind"], "Pod");
    let spec = &pod["spec"];
    assert_eq!(
        spec["hostNetwork"], true,
        "the dataplane needs the DPU's interfaces"
    );
    let strs = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .expect("list")
            .iter()
            .map(|s| s.as_str().expect("string").to_owned())
            .collect()
    };
    let containers = spec["initContainers"]
        .as_array()
        .expect("init")
        .iter()
        .chain(spec["containers"].as_array().expect("containers"));
    let mut metrics_port = None;
    for c in containers {
        let command = strs(&c["command"]);
        assert!(command[0].ends_with("/dpuflow"), "{command:?}");
        let text = help(&command[1]);
        for flag in command.iter().filter(|a| a.starts_with("--")) {
            assert!(
                text.contains(flag.as_str()),
                "`dpuflow {}` has no {flag}",
                command[1]
            );
        }
        if let Some(at) = command.iter().position(|a| a == "--metrics") {
            let addr = &command[at + 1];
            metrics_port = Some(addr.rsplit_once(':').expect("ADDR:PORT").1.to_owned());
        }
    }
    let port: u16 = metrics_port
        .expect("the service's --metrics")
        .parse()
        .expect("port");
    let run = &spec["containers"][0];
    assert_eq!(run["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(run["readinessProbe"]["httpGet"]["path"], "/readyz");
    for probe in ["livenessProbe", "readinessProbe"] {
        assert_eq!(run[probe]["httpGet"]["port"], port, "{probe}");
    }
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"],
        port.to_string()
    );
    // The capabilities are the systemd unit's.
    let unit = std::fs::read_to_string("deploy/systemd/dpuflow.service").expect("unit");
    let mut from_unit: Vec<String> = unit
        .lines()
        .find_map(|l| l.strip_prefix("AmbientCapabilities="))
        .expect("capabilities")
        .split_whitespace()
        .map(|c| c.trim_start_matches("CAP_").to_owned())
        .collect();
    let mut from_pod = strs(&run["securityContext"]["capabilities"]["add"]);
    from_unit.sort();
    from_pod.sort();
    assert_eq!(from_pod, from_unit);
}
