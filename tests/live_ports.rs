//! Live ports: `dpuflow run` on AF_PACKET sockets, in the path between two Linux hosts.
//! A client namespace and a server namespace are joined through a third, where dpuflow
//! runs the stateful firewall example on the two veth ends (a bump in the wire: the
//! hosts share a subnet). Real kernel TCP stacks and ping talk through it: a file fetched
//! over HTTP from inside arrives whole, connections and pings from outside do not get in,
//! the metrics count what crossed, and SIGTERM stops it cleanly.
//!
//! Needs root for `ip netns`; all traffic stays inside the namespaces.

mod common;
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Three namespaces: client (inside), dut (dpuflow), server (outside).
struct Lab {
    client: String,
    dut: String,
    server: String,
}

const CLIENT: &str = "10.77.0.1";
const SERVER: &str = "10.77.0.2";

impl Lab {
    fn new() -> Lab {
        let id = std::process::id();
        let lab = Lab {
            client: format!("dpl{id}c"),
            dut: format!("dpl{id}d"),
            server: format!("dpl{id}s"),
        };
        for n in [&lab.client, &lab.dut, &lab.server] {
            let out = tool("ip", &["netns", "add", n]);
            assert!(
                out.status.success(),
                "ip netns add {n} (this test needs root): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        for (host, end, dut_end) in [(&lab.client, "c0", "in0"), (&lab.server, "s0", "out0")] {
            tool_ok(
                "ip",
                &[
                    "link", "add", end, "netns", host, "type", "veth", "peer", "name", dut_end,
                    "netns", &lab.dut,
                ],
            );
        }
        lab.run(
            &lab.client,
            &["ip", "addr", "add", &format!("{CLIENT}/24"), "dev", "c0"],
        );
        lab.run(
            &lab.server,
            &["ip", "addr", "add", &format!("{SERVER}/24"), "dev", "s0"],
        );
        for (ns, iface) in [
            (&lab.client, "c0"),
            (&lab.dut, "in0"),
            (&lab.dut, "out0"),
            (&lab.server, "s0"),
        ] {
            lab.run(ns, &["ip", "link", "set", iface, "up"]);
            // A veth hands over what the hardware would finish: checksums left to fill
            // and segments left to cut. A bump in the wire sees frames as they are sent.
            lab.run(
                ns,
                &[
                    "ethtool", "-K", iface, "tx", "off", "tso", "off", "gso", "off", "gro", "off",
                ],
            );
        }
        for ns in [&lab.client, &lab.dut, &lab.server] {
            lab.run(ns, &["ip", "link", "set", "lo", "up"]);
        }
        // The example pipeline forwards IP only: each host knows the other's address.
        let mac = |ns: &str, iface: &str| {
            let out = lab.run(ns, &["cat", &format!("/sys/class/net/{iface}/address")]);
            out.trim().to_owned()
        };
        let (client_mac, server_mac) = (mac(&lab.client, "c0"), mac(&lab.server, "s0"));
        for (ns, peer, lladdr, iface) in [
            (&lab.client, SERVER, &server_mac, "c0"),
            (&lab.server, CLIENT, &client_mac, "s0"),
        ] {
            lab.run(
                ns,
                &[
                    "ip",
                    "neigh",
                    "replace",
                    peer,
                    "lladdr",
                    lladdr,
                    "dev",
                    iface,
                    "nud",
                    "permanent",
                ],
            );
        }
        lab
    }

    fn run(&self, ns: &str, args: &[&str]) -> String {
        let mut full = vec!["netns", "exec", ns];
        full.extend_from_slice(args);
        tool_ok("ip", &full)
    }

    fn spawn(&self, ns: &str, args: &[&str]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{args:?}: {e}"))
    }

    /// `curl` in `ns`: the HTTP status and the bytes received, or none when no connection
    /// was made within `timeout`.
    fn fetch(&self, ns: &str, url: &str, timeout: &str) -> Option<(u16, u64)> {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, "curl", "-s", "-o", "/dev/null"])
            .args([
                "-w",
                "%{http_code} %{size_download}",
                "--max-time",
                timeout,
                url,
            ])
            .output()
            .expect("curl is required (scripts/test installs it)");
        let text = String::from_utf8_lossy(&out.stdout);
        let (code, size) = text.split_once(' ')?;
        let code: u16 = code.parse().ok()?;
        (code != 0).then(|| (code, size.parse().unwrap_or(0)))
    }

    fn ping(&self, ns: &str, to: &str) -> bool {
        Command::new("ip")
            .args([
                "netns", "exec", ns, "ping", "-c", "2", "-i", "0.2", "-W", "1", to,
            ])
            .stdout(Stdio::null())
            .status()
            .expect("ping")
            .success()
    }

    /// The service's exposition; empty while it is not serving.
    fn metrics(&self) -> String {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.dut,
                "curl",
                "-s",
                "http://127.0.0.1:9464/metrics",
            ])
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for n in [&self.client, &self.dut, &self.server] {
            let _ = Command::new("ip").args(["netns", "del", n]).status();
        }
    }
}

/// Stops a child process when dropped, so a failing test leaves nothing running.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_stateful_firewall_runs_between_two_hosts() {
    let lab = Lab::new();
    let dir = Scratch::new("live-ports");
    let pipe = std::fs::read_to_string("pipelines/stateful-firewall.pipe")
        .expect("example")
        .replace("iface \"pf0hpf\"", "iface \"in0\"")
        .replace("iface \"p0\"", "iface \"out0\"");
    let pipe_path = dir.path("firewall.pipe");
    std::fs::write(&pipe_path, pipe).expect("write pipeline");
    // A file large enough for many segments and window updates, served from each side.
    let body: Vec<u8> = (0..2_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.0.join("file.bin"), &body).expect("write file");
    let serve = |ns: &str, addr: &str, port: &str| {
        Running(lab.spawn(
            ns,
            &[
                PYTHON,
                "-m",
                "http.server",
                port,
                "--bind",
                addr,
                "--directory",
                &dir.path(""),
            ],
        ))
    };
    let _outside_server = serve(&lab.server, SERVER, "80");
    let _inside_server = serve(&lab.client, CLIENT, "8080");

    let bin = env!("CARGO_BIN_EXE_dpuflow");
    let mut dpuflow = Running(lab.spawn(
        &lab.dut,
        &[
            bin,
            "run",
            &pipe_path,
            "--metrics",
            "127.0.0.1:9464",
            "--workers",
            "2",
        ],
    ));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !lab.metrics().contains("dpuflow_build_info") {
        assert!(
            Instant::now() < deadline,
            "dpuflow run never served metrics"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The servers take a moment to listen.
    let deadline = Instant::now() + Duration::from_secs(10);
    let fetched = loop {
        match lab.fetch(&lab.client, &format!("http://{SERVER}/file.bin"), "5") {
            Some(got) => break got,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
            None => panic!("no HTTP connection from inside to outside through dpuflow"),
        }
    };
    assert_eq!(fetched, (200, body.len() as u64), "the file arrives whole");
    assert!(
        lab.ping(&lab.client, SERVER),
        "ping from inside is answered"
    );

    // From outside, only tracked connections get in: a new one does not, nor a ping.
    assert_eq!(
        lab.fetch(&lab.server, &format!("http://{CLIENT}:8080/file.bin"), "2"),
        None,
        "a connection from outside got in"
    );
    assert!(!lab.ping(&lab.server, CLIENT), "a ping from outside got in");

    let m = lab.metrics();
    let count = |series: &str| metric(&m, series).unwrap_or_else(|| panic!("{series}:\n{m}"));
    assert!(count("dpuflow_port_received_packets_total{port=\"inside\"}") > 100);
    assert!(count("dpuflow_port_received_packets_total{port=\"outside\"}") > 1000);
    assert!(
        count("dpuflow_rule_matched_packets_total{pipe=\"egress\",rule=\"tcp_services\"}") > 100
    );
    assert!(count("dpuflow_rule_matched_packets_total{pipe=\"egress\",rule=\"ping\"}") >= 2);
    // The SYNs from outside (and their retries) and the pings from outside.
    assert!(count("dpuflow_rule_matched_packets_total{pipe=\"ingress\",rule=\"default\"}") >= 3);
    let tcp_invalid: Vec<u64> = m
        .lines()
        .filter(|l| l.starts_with("dpuflow_conntrack_invalid_packets_total{reason=\"tcp_"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .collect();
    assert!(tcp_invalid.len() >= 7, "{m}");
    let invalid: u64 = tcp_invalid.iter().sum();
    assert_eq!(
        invalid, 0,
        "every segment of the transfer fits its window:\n{m}"
    );

    let pid = dpuflow.0.id().to_string();
    tool_ok("kill", &["-TERM", &pid]);
    let status = dpuflow.0.wait().expect("wait");
    let mut log = String::new();
    std::io::Read::read_to_string(&mut dpuflow.0.stderr.take().expect("stderr"), &mut log)
        .expect("log");
    assert!(status.success(), "exit {status}:\n{log}");
    assert!(
        log.contains("live port open (AF_PACKET) iface=\"in0\""),
        "{log}"
    );
}
