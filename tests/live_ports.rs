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

/// Rules that forward the client's UDP to the server and drop the rest (the hosts' own
/// frames, such as IPv6 neighbour discovery as links come up).
const UDP_OUT: &str = "pipe out root from inside {\n\
                           rule udp { match ip.proto 17  actions fwd outside }\n\
                           default { actions drop }\n\
                       }\n";

/// Three namespaces: client (inside), dut (dpuflow), server (outside).
struct Lab {
    client: String,
    dut: String,
    server: String,
}

const CLIENT: &str = "10.77.0.1";
const SERVER: &str = "10.77.0.2";

impl Lab {
    /// The namespaces and links, of `queues` receive and transmit queues (a veth hands a
    /// frame to the peer's receive queue of the number its sender's transmit queue has);
    /// `tag` keeps the names of tests running at once apart.
    fn with_queues(tag: &str, queues: u16) -> Lab {
        let id = std::process::id();
        let lab = Lab {
            client: format!("dpl{id}{tag}c"),
            dut: format!("dpl{id}{tag}d"),
            server: format!("dpl{id}{tag}s"),
        };
        add_netns(&[&lab.client, &lab.dut, &lab.server]);
        lab.link(&lab.client, "c0", "in0", queues);
        lab.link(&lab.server, "s0", "out0", queues);
        let hosts = [(&lab.client, "c0", CLIENT), (&lab.server, "s0", SERVER)];
        for (ns, link, addr) in &hosts {
            lab.run(
                ns,
                &["ip", "addr", "add", &format!("{addr}/24"), "dev", link],
            );
        }
        for ns in [&lab.client, &lab.dut, &lab.server] {
            lab.run(ns, &["ip", "link", "set", "lo", "up"]);
        }
        // The example pipeline forwards IP only: each host knows the other's address.
        let macs = hosts.each_ref().map(|(ns, link, _)| lab.mac(ns, link));
        for (i, (ns, link, _)) in hosts.iter().enumerate() {
            let (peer, lladdr) = (hosts[1 - i].2, &macs[1 - i]);
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
                    link,
                    "nud",
                    "permanent",
                ],
            );
        }
        lab
    }

    /// A veth link of `queues` queues from `end` in namespace `host` to `dut_end` in the
    /// dut's, both up.
    fn link(&self, host: &str, end: &str, dut_end: &str, queues: u16) {
        let q = queues.to_string();
        let queues = ["numrxqueues", &q, "numtxqueues", &q];
        let mut args = vec!["link", "add", end, "netns", host];
        args.extend(queues);
        args.extend(["type", "veth", "peer", "name", dut_end, "netns", &self.dut]);
        args.extend(queues);
        tool_ok("ip", &args);
        for (ns, iface) in [(host, end), (&self.dut, dut_end)] {
            self.run(ns, &["ip", "link", "set", iface, "up"]);
            // A veth hands over segments left for the hardware to cut (and merges what
            // it receives): a bump in the wire must see frames as they would be on a
            // wire. (Checksums left unfinished, it finishes itself.)
            self.run(
                ns,
                &[
                    "ethtool", "-K", iface, "tso", "off", "gso", "off", "gro", "off",
                ],
            );
        }
    }

    fn run(&self, ns: &str, args: &[&str]) -> String {
        in_netns(ns, args)
    }

    /// The MAC address of `iface` in `ns`.
    fn mac(&self, ns: &str, iface: &str) -> String {
        let out = self.run(ns, &["cat", &format!("/sys/class/net/{iface}/address")]);
        out.trim().to_owned()
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

    /// An HTTP server in `ns` on `addr`:`port`, serving the files of `dir`.
    fn serve(&self, ns: &str, addr: &str, port: &str, dir: &Scratch) -> Running {
        let root = dir.path("");
        let args = [
            PYTHON,
            "-m",
            "http.server",
            port,
            "--bind",
            addr,
            "--directory",
            &root,
        ];
        Running(self.spawn(ns, &args))
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

    /// The client fetches `file.bin` of `len` bytes from the server (each try given
    /// `timeout`), trying again for 10 s while no connection is made (then failing the
    /// test with `never`); the file must arrive whole.
    fn fetch_whole_file(&self, timeout: &str, len: usize, never: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let fetched = loop {
            match self.fetch(&self.client, &format!("http://{SERVER}/file.bin"), timeout) {
                Some(got) => break got,
                None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(200)),
                None => panic!("{never}"),
            }
        };
        assert_eq!(fetched, (200, len as u64), "the file arrives whole");
    }

    /// How many of `n` UDP datagrams sent from `ns` to port 53 of `to`, each from a port of
    /// its own, were answered by an ICMP port unreachable (ECONNREFUSED) within a second.
    fn refused_queries(&self, ns: &str, to: &str, n: usize) -> usize {
        let script = format!(
            "import socket\n\
             refused = 0\n\
             for _ in range({n}):\n\
             \x20   s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n\
             \x20   s.settimeout(1)\n\
             \x20   s.connect(('{to}', 53))\n\
             \x20   s.send(b'query')\n\
             \x20   try:\n\
             \x20       s.recv(512)\n\
             \x20   except ConnectionRefusedError:\n\
             \x20       refused += 1\n\
             \x20   except socket.timeout:\n\
             \x20       pass\n\
             print(refused)\n"
        );
        let out = Command::new("ip")
            .args(["netns", "exec", ns, PYTHON, "-c", &script])
            .output()
            .expect("python3 is required (scripts/test installs it)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a count")
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

/// tcpdump writing what the server's link receives into a capture.
struct Capture(Child);

impl Capture {
    /// Stops the capture (what it holds is written) after a moment for the last frames.
    fn stop(mut self) {
        std::thread::sleep(Duration::from_millis(500));
        tool_ok("kill", &["-INT", &self.0.id().to_string()]);
        self.0.wait().expect("tcpdump");
    }
}

impl Lab {
    /// Starts tcpdump on the server's link, writing the frames `filter` takes to `pcap`,
    /// and waits until it listens.
    fn capture(&self, pcap: &str, filter: &str) -> Capture {
        let mut tcpdump = Command::new("ip")
            .args(["netns", "exec", &self.server, "tcpdump", "-Z", "root"])
            .args([
                "--immediate-mode",
                "-i",
                "s0",
                "-U",
                "-n",
                "-w",
                pcap,
                filter,
            ])
            .stderr(Stdio::piped())
            .spawn()
            .expect("tcpdump is required (scripts/test installs it)");
        let mut err = std::io::BufReader::new(tcpdump.stderr.take().expect("stderr"));
        let mut line = String::new();
        while !line.contains("listening on") {
            line.clear();
            let n = std::io::BufRead::read_line(&mut err, &mut line).expect("tcpdump");
            assert!(n > 0, "tcpdump did not start");
        }
        Capture(tcpdump)
    }

    /// Sends `count` UDP datagrams from the client to the server's port `dport`.
    /// Through a service running [`UDP_OUT`]: 600 datagrams of 64 flows to port 5001 and 5
    /// to 5003 each reach the server once, and are counted and sent; the metrics then.
    fn udp_crosses_once(&self) -> String {
        let counter = self.count_at_server(5003);
        self.send_udp_flows(5001, 600, 64);
        self.send_udp(5003, 5);
        assert_eq!(counter.seen(), "5001:600 5003:5", "what crossed");
        let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
        let sent = "dpuflow_port_transmitted_packets_total{port=\"outside\"}";
        self.metrics_until(
            |m| metric(m, udp) == Some(605) && metric(m, sent) == Some(605),
            "counted and sent all 605",
        )
    }

    fn send_udp(&self, dport: u16, count: usize) {
        self.send_udp_flows(dport, count, 1);
    }

    /// Sends `count` UDP datagrams from the client to the server's port `dport`, from
    /// `flows` source ports in turn.
    fn send_udp_flows(&self, dport: u16, count: usize, flows: usize) {
        let send = format!(
            "from scapy.all import *\n\
             e = Ether(src='02:00:00:00:00:01', dst='02:00:00:00:00:02')\n\
             fs = [e/IP(src='{CLIENT}', dst='{SERVER}')/UDP(sport=4000 + i % {flows}, \
             dport={dport}) for i in range({count})]\n\
             sendp(fs, iface='c0', verbose=0)\n"
        );
        self.run(&self.client, &[PYTHON, "-c", &send]);
    }

    /// Starts `dpuflow run PIPE` in the dut namespace and waits until it serves metrics.
    fn start(&self, pipe: &str, workers: &str) -> Running {
        self.start_with(&[], pipe, workers, &[])
    }

    /// [`Lab::start`] with `env` (`NAME=value`) added to its environment, and `flags`.
    fn start_with(&self, env: &[&str], pipe: &str, workers: &str, flags: &[&str]) -> Running {
        let dpuflow = self.start_serving(env, pipe, workers, flags);
        // Serving comes before the workers are up: traffic waits for /readyz (on a busy
        // machine the gap outlasted a ping's wait, and the stateful firewall's connection
        // tables, hundreds of MB made in a debug build, once outlasted 5 s).
        self.until_ready(Duration::from_secs(30), "dpuflow run never ready");
        dpuflow
    }

    /// Runs `dpuflow run PIPE` in the dut namespace to its end (a start it refuses):
    /// how it exited, and what it said.
    fn run_once(&self, pipe: &str) -> (std::process::ExitStatus, String) {
        let bin = env!("CARGO_BIN_EXE_dpuflow");
        let out = Command::new("ip")
            .args(["netns", "exec", &self.dut, bin, "run", pipe])
            .output()
            .expect("dpuflow run");
        (
            out.status,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Waits until `/readyz` says ready, failing the test with `never` after `limit`.
    fn until_ready(&self, limit: Duration, never: &str) {
        let deadline = Instant::now() + limit;
        while !self.ready() {
            assert!(Instant::now() < deadline, "{never}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Makes the client's link to the dut (`c0`, `in0`) anew, as a test that removed it
    /// needs, then waits until the service has opened its inside port on it and is ready.
    fn link_inside_again(&self, driver: &str, queues: u16) {
        self.link(&self.client, "c0", "in0", queues);
        if driver == "af_xdp" {
            self.run(&self.client, &["ethtool", "-K", "c0", "tx", "off"]);
        }
        let open = "dpuflow_port_open{port=\"inside\"}";
        self.metrics_until(|m| metric(m, open) == Some(1), "opened the inside port");
        self.until_ready(Duration::from_secs(5), &format!("{driver}: never ready"));
    }

    /// Starts `dpuflow run PIPE` as [`Lab::start_with`] does, waiting only until it serves
    /// metrics.
    fn start_serving(&self, env: &[&str], pipe: &str, workers: &str, flags: &[&str]) -> Running {
        let bin = env!("CARGO_BIN_EXE_dpuflow");
        let mut args = vec!["env"];
        args.extend(env);
        args.extend([
            bin,
            "run",
            pipe,
            "--metrics",
            "127.0.0.1:9464",
            "--workers",
            workers,
        ]);
        args.extend(flags);
        let dpuflow = Running(self.spawn(&self.dut, &args));
        self.metrics_until(|m| m.contains("dpuflow_build_info"), "dpuflow run serving");
        dpuflow
    }

    /// Whether the service's `/readyz` says ready.
    fn ready(&self) -> bool {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.dut,
                "curl",
                "-sf",
                "-o",
                "/dev/null",
                "http://127.0.0.1:9464/readyz",
            ])
            .status()
            .expect("curl")
            .success()
    }

    /// The exposition once `done` holds for it (workers publish every 100 ms); fails the
    /// test naming `what` after 5 s.
    fn metrics_until(&self, done: impl Fn(&str) -> bool, what: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = self.metrics();
            if done(&m) {
                return m;
            }
            assert!(Instant::now() < deadline, "never {what}:\n{m}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// A Python script in a namespace that prints `listening` once ready, then one line of
/// what it saw. SIGINT raises KeyboardInterrupt in it even where the test runs with SIGINT
/// ignored (as a shell's background job does, and Python then leaves it so).
struct Watcher {
    child: Child,
    out: std::io::BufReader<std::process::ChildStdout>,
}

impl Watcher {
    /// Starts `script` in `ns` and waits until it listens.
    fn start(ns: &str, script: &str) -> Watcher {
        let script = format!(
            "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n{script}"
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, PYTHON, "-c", &script])
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3");
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        std::io::BufRead::read_line(&mut out, &mut line).expect("watcher");
        assert_eq!(line.trim(), "listening");
        Watcher { child, out }
    }

    /// Interrupts it (SIGINT) a moment after what it waits for was sent, and returns
    /// [`Watcher::seen`].
    fn interrupt(self) -> String {
        std::thread::sleep(Duration::from_millis(500));
        tool_ok("kill", &["-INT", &self.child.id().to_string()]);
        self.seen()
    }

    /// The line it printed at its end.
    fn seen(mut self) -> String {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut self.out, &mut line).expect("what it saw");
        self.child.wait().expect("watcher");
        line.trim().to_owned()
    }
}

/// A test that fails before it reads what a watcher saw stops it: left running, it would
/// keep the test's output open (and its namespace) after the test has ended.
impl Drop for Watcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Lab {
    /// Counts the UDP datagrams the server's link receives by destination port, with a
    /// packet socket (it reads on through the link's going down and up: tcpdump gives up
    /// when its link goes down), until five to `last` have arrived (or a minute has passed:
    /// a busy machine runs the steps between slowly);
    /// [`Watcher::seen`] is `port:count` for each port, in order.
    fn count_at_server(&self, last: u16) -> Watcher {
        let count = format!(
            r#"
import socket, struct, sys, time, errno
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
s.bind(("s0", 0))
s.settimeout(0.2)
print("listening", flush=True)
seen, end = {{}}, time.time() + 60
while time.time() < end and seen.get({last}, 0) < 5:
    try:
        f = s.recv(2048)
    except socket.timeout:
        continue
    except OSError as e:
        if e.errno == errno.ENETDOWN:
            continue
        raise
    if len(f) >= 38 and f[23] == 17:
        port = struct.unpack("!H", f[36:38])[0]
        seen[port] = seen.get(port, 0) + 1
print(" ".join("%d:%d" % kv for kv in sorted(seen.items())), flush=True)
"#
        );
        Watcher::start(&self.server, &count)
    }
}

/// Stops a service with SIGTERM, asserts it exited cleanly, and returns its log.
fn stop(mut dpuflow: Running) -> String {
    tool_ok("kill", &["-TERM", &dpuflow.0.id().to_string()]);
    let status = dpuflow.0.wait().expect("wait");
    let mut log = String::new();
    std::io::Read::read_to_string(&mut dpuflow.0.stderr.take().expect("stderr"), &mut log)
        .expect("log");
    assert!(status.success(), "exit {status}:\n{log}");
    log
}

impl Drop for Lab {
    fn drop(&mut self) {
        del_netns(&[&self.client, &self.dut, &self.server]);
    }
}

impl Lab {
    /// A lab (see [`Lab::with_queues`]), a scratch directory, and in it a pipeline whose ports
    /// `inside` and `outside` are the dut's two links (live), followed by `body`: its path.
    fn with_pipeline(tag: &str, body: &str) -> (Lab, Scratch, String) {
        Lab::with_pipeline_on("af_packet", tag, body)
    }

    /// [`Lab::with_pipeline`] with ports of `driver`.
    fn with_pipeline_on(driver: &str, tag: &str, body: &str) -> (Lab, Scratch, String) {
        Lab::with_pipeline_queues(driver, tag, 1, body)
    }

    /// [`Lab::with_pipeline_on`] with links of `queues` queues.
    fn with_pipeline_queues(
        driver: &str,
        tag: &str,
        queues: u16,
        body: &str,
    ) -> (Lab, Scratch, String) {
        let dir = Scratch::new(&format!("live-{tag}"));
        let path = dir.path("live.pipe");
        let text = format!(
            "pipeline live\n\
             port inside  {{ driver {driver}  iface \"in0\" }}\n\
             port outside {{ driver {driver}  iface \"out0\" }}\n\
             {body}"
        );
        std::fs::write(&path, text).expect("write pipeline");
        (Lab::for_driver_with_queues(driver, tag, queues), dir, path)
    }

    /// A lab for ports of `driver`: for AF_XDP, the hosts finish their own checksums (a
    /// veth leaves them to the receiver, and XDP runs before anything finishes them).
    fn for_driver(driver: &str, tag: &str) -> Lab {
        Lab::for_driver_with_queues(driver, tag, 1)
    }

    fn for_driver_with_queues(driver: &str, tag: &str, queues: u16) -> Lab {
        let lab = Lab::with_queues(tag, queues);
        if driver == "af_xdp" {
            for (ns, iface) in [(&lab.client, "c0"), (&lab.server, "s0")] {
                lab.run(ns, &["ethtool", "-K", iface, "tx", "off"]);
            }
        }
        lab
    }
}

#[test]
fn the_stateful_firewall_runs_between_two_hosts() {
    firewall_between_two_hosts("af_packet", "AF_PACKET mapped receive ring", "f");
}

/// The same through AF_XDP: an XDP program steers each link's frames to dpuflow's
/// sockets before the dut's kernel sees them.
#[test]
fn the_stateful_firewall_runs_between_two_hosts_through_af_xdp() {
    // A veth has one queue, and no zero-copy AF_XDP.
    firewall_between_two_hosts("af_xdp", "AF_XDP 1 queue(s), copy", "a");
}

/// `log` is the socket family and mode the service logs for the port.
fn firewall_between_two_hosts(driver: &str, log: &str, tag: &str) {
    let (family, mode) = log.split_once(' ').expect("family and mode");
    let lab = Lab::for_driver(driver, tag);
    let dir = Scratch::new(&format!("live-ports-{driver}"));
    let pipe = std::fs::read_to_string("pipelines/stateful-firewall.pipe")
        .expect("example")
        .replace("iface \"pf0hpf\"", "iface \"in0\"")
        .replace("iface \"p0\"", "iface \"out0\"")
        .replace("driver af_packet", &format!("driver {driver}"));
    let pipe_path = dir.path("firewall.pipe");
    std::fs::write(&pipe_path, pipe).expect("write pipeline");
    // A file large enough for many segments and window updates, served from each side.
    let body: Vec<u8> = (0..2_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.0.join("file.bin"), &body).expect("write file");
    let _outside_server = lab.serve(&lab.server, SERVER, "80", &dir);
    let _inside_server = lab.serve(&lab.client, CLIENT, "8080", &dir);

    let dpuflow = lab.start(&pipe_path, "2");
    // The servers take a moment to listen.
    lab.fetch_whole_file(
        "5",
        body.len(),
        "no HTTP connection from inside to outside through dpuflow",
    );
    // More connections, each a new flow for the workers' steering to keep together.
    for n in 0..12 {
        let got = lab.fetch(&lab.client, &format!("http://{SERVER}/"), "5");
        assert!(
            got.is_some_and(|(code, _)| code == 200),
            "connection {n} from inside"
        );
    }
    assert!(
        lab.ping(&lab.client, SERVER),
        "ping from inside is answered"
    );
    // DNS queries to an outside host that serves none: each one's ICMP port unreachable is
    // related to its flow, and gets in (the worker that holds the flow must see it). The
    // outside host sends every such error (Linux limits them to a few a second a peer).
    lab.run(&lab.server, &["sysctl", "-qw", "net.ipv4.icmp_ratelimit=0"]);
    assert_eq!(lab.refused_queries(&lab.client, SERVER, 16), 16);

    // From outside, only tracked connections get in: a new one does not, nor a ping.
    assert_eq!(
        lab.fetch(&lab.server, &format!("http://{CLIENT}:8080/file.bin"), "2"),
        None,
        "a connection from outside got in"
    );
    assert!(!lab.ping(&lab.server, CLIENT), "a ping from outside got in");

    let blocked = "dpuflow_rule_matched_packets_total{pipe=\"ingress\",rule=\"default\"}";
    let m = lab.metrics_until(
        |m| metric(m, blocked).unwrap_or(0) >= 3,
        "counted what came from outside",
    );
    let count = |series: &str| metric(&m, series).unwrap_or_else(|| panic!("{series}:\n{m}"));
    assert!(
        count("dpuflow_port_received_packets_total{port=\"inside\"}") > 100,
        "{m}"
    );
    assert!(count("dpuflow_port_received_packets_total{port=\"outside\"}") > 1000);
    assert!(
        count("dpuflow_rule_matched_packets_total{pipe=\"egress\",rule=\"tcp_services\"}") > 100
    );
    assert!(count("dpuflow_rule_matched_packets_total{pipe=\"egress\",rule=\"ping\"}") >= 2);
    // The SYNs from outside (and their retries) and the pings from outside.
    assert!(count("dpuflow_rule_matched_packets_total{pipe=\"ingress\",rule=\"default\"}") >= 3);
    // Nothing was invalid: every segment of the transfer fits its window, and the hosts'
    // IPv6 neighbour discovery and multicast reports are untracked, as in Linux.
    let invalid: Vec<u64> = m
        .lines()
        .filter(|l| l.starts_with("dpuflow_conntrack_invalid_packets_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .collect();
    assert!(invalid.len() >= 12, "{m}");
    assert_eq!(invalid.iter().sum::<u64>(), 0, "{m}");

    let log = stop(dpuflow);
    assert!(
        log.contains(&format!(
            "live port open iface=\"in0\" driver=\"{family}\" mode={mode}"
        )),
        "{log}"
    );
    // Connections are tracked: both directions must meet in one worker's table. Through
    // AF_PACKET the kernel steers them there, each worker reading its own share.
    let how = if driver == "af_packet" {
        "each worker reads and sends its own share of the live ports (AF_PACKET fanout, \
         steered by a program of the dealer's choice"
    } else {
        "the I/O thread deals the live ports' packets to the workers: the pipeline tracks \
         connections and a port uses AF_XDP"
    };
    assert!(log.contains(how), "{log}");
}

/// A reload (SIGHUP) changes the firewall under live traffic: a download running across
/// it arrives whole — its connection is kept, and the new pipeline lets only a SYN open
/// one (`tcp_loose off`), so a connection forgotten by the reload could not be picked up
/// again — while pings from inside, allowed before, are dropped after, and the rules
/// kept count on from where they were.
#[test]
fn a_reload_changes_the_rules_and_keeps_the_connections() {
    let lab = Lab::for_driver("af_packet", "r");
    let dir = Scratch::new("live-reload");
    let example = std::fs::read_to_string("pipelines/stateful-firewall.pipe")
        .expect("example")
        .replace("iface \"pf0hpf\"", "iface \"in0\"")
        .replace("iface \"p0\"", "iface \"out0\"");
    let pipe_path = dir.path("firewall.pipe");
    std::fs::write(&pipe_path, &example).expect("write pipeline");
    let body: Vec<u8> = (0..1_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(dir.0.join("file.bin"), &body).expect("write file");
    let _server = lab.serve(&lab.server, SERVER, "80", &dir);
    let dpuflow = lab.start(&pipe_path, "2");
    assert!(
        lab.ping(&lab.client, SERVER),
        "ping from inside is answered"
    );

    // A download of some seconds, started once the server listens.
    let url = format!("http://{SERVER}/file.bin");
    let deadline = Instant::now() + Duration::from_secs(10);
    while lab
        .fetch(&lab.client, &format!("http://{SERVER}/"), "2")
        .is_none()
    {
        assert!(Instant::now() < deadline, "the server never answered");
        std::thread::sleep(Duration::from_millis(200));
    }
    let download = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.client,
            "curl",
            "-s",
            "-o",
            "/dev/null",
        ])
        .args([
            "-w",
            "%{http_code} %{size_download}",
            "--limit-rate",
            "250k",
        ])
        .args(["--max-time", "30", &url])
        .stdout(Stdio::piped())
        .spawn()
        .expect("curl");
    let services = "dpuflow_rule_matched_packets_total{pipe=\"egress\",rule=\"tcp_services\"}";
    let before = lab.metrics_until(
        |m| metric(m, services).unwrap_or(0) > 50,
        "counted the download's first segments",
    );

    // The reloaded pipeline also carries VXLAN on a port of its own: the kernel's
    // steering of the two workers' shares learns it.
    let overlay = "    rule overlay      { match udp.dst 9999  actions vxlan.encap { vni 5  \
                   src 192.0.2.1  dst 192.0.2.2  smac 02:00:00:00:00:01  \
                   dmac 02:00:00:00:00:02  dport 8472 }, fwd outside }\n";
    let reloaded = example
        .replace("    rule ping         { match icmp.type 8            actions ct.commit, fwd outside }\n", overlay)
        .replace("tcp_window on", "tcp_window on\n    tcp_loose off");
    assert_ne!(reloaded, example);
    std::fs::write(&pipe_path, reloaded).expect("write pipeline");
    tool_ok("kill", &["-HUP", &dpuflow.0.id().to_string()]);
    let reloads = "dpuflow_pipeline_reloads_total{result=\"success\"}";
    let after = lab.metrics_until(|m| metric(m, reloads) == Some(1), "reloaded");
    assert!(
        metric(&after, services) >= metric(&before, services),
        "the rule's count went on:\n{before}\n{after}"
    );
    assert!(
        !lab.ping(&lab.client, SERVER),
        "a ping got out after the reload"
    );

    let out = download.wait_with_output().expect("curl");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        format!("200 {}", body.len()),
        "the download across the reload arrives whole"
    );
    let m = lab.metrics();
    assert!(metric(&m, services) > metric(&after, services), "{m}");
    assert!(
        !m.contains("rule=\"ping\""),
        "the removed rule has no series:\n{m}"
    );
    let log = stop(dpuflow);
    assert!(log.contains("pipeline reloaded"), "{log}");
    assert!(
        log.contains("the fanout groups are steered by the new tunnel ports"),
        "{log}"
    );
}

/// Tagged frames cross with their tags: the kernel takes the VLAN tag out of each frame
/// a veth receives, and the port puts it back, so the pipeline matches the VLAN and the
/// frames leave tagged. tcpdump on the far host sees every frame on VLAN 100; a frame
/// longer than the port's MTU allows is dropped and counted oversize.
#[test]
fn tagged_frames_keep_their_tags() {
    let (lab, dir, pipe_path) = Lab::with_pipeline(
        "v",
        "pipe out root from inside {\n\
             rule tagged { match vlan.id 100  actions fwd outside }\n\
             default { actions drop }\n\
         }\n",
    );
    let _dpuflow = lab.start(&pipe_path, "1");
    let pcap = dir.path("far.pcap");
    let far = lab.capture(&pcap, "vlan");
    // And one jumbo frame, past what the port's `mtu` (1500) lets its ring hold.
    lab.run(&lab.client, &["ip", "link", "set", "c0", "mtu", "9000"]);
    lab.run(&lab.dut, &["ip", "link", "set", "in0", "mtu", "9000"]);
    let send = format!(
        "from scapy.all import *\n\
         f = Ether(src='02:00:00:00:00:01', dst='02:00:00:00:00:02')/Dot1Q(vlan=100, prio=5)\
         /IP(src='{CLIENT}', dst='{SERVER}')/UDP(sport=4000, dport=5000)\n\
         sendp([f/Raw(b'tagged')] * 20 + [f/Raw(b'j' * 3000)], iface='c0', verbose=0)\n"
    );
    lab.run(&lab.client, &[PYTHON, "-c", &send]);
    far.stop();
    let seen = tshark_fields(&pcap, &["vlan.id", "vlan.priority", "udp.dstport"]);
    assert_eq!(seen, vec!["100,5,5000"; 20], "frames at the far host");
    let series = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"tagged\"}";
    let m = lab.metrics_until(
        |m| metric(m, series) == Some(20),
        "counted 20 tagged frames",
    );
    let series = "dpuflow_port_dropped_packets_total{port=\"inside\",reason=\"oversize\"}";
    assert_eq!(metric(&m, series), Some(1), "{m}");
}

/// A tagged frame too big for the tunnel once encapsulated: its sender is told the MTU
/// inside the tunnel (ICMP Fragmentation Needed) on its VLAN. The kernel took the tag out
/// as the frame arrived; the port put it back where every received frame starts, so the
/// gateway knows the tunnel carries the frame as it came.
#[test]
fn tagged_frames_too_big_for_the_tunnel_are_answered_on_their_vlan() {
    let (lab, _dir, pipe_path) = Lab::with_pipeline(
        "w",
        "pipe out root from inside {\n\
             rule tunnelled { match vlan.id 200  actions vxlan.encap { vni 5  src 192.0.2.1  \
               dst 192.0.2.2  smac 02:00:00:00:00:01  dmac 02:00:00:00:00:02 }, fwd outside }\n\
             default { actions drop }\n\
         }\n",
    );
    let _dpuflow = lab.start(&pipe_path, "1");
    let send = format!(
        "from scapy.all import *\n\
         f = Ether(src='02:00:00:00:00:01', dst='02:00:00:00:00:02')/Dot1Q(vlan=200)\
         /IP(src='{CLIENT}', dst='{SERVER}', flags='DF')/UDP(sport=4000, dport=5000)/Raw(b'b' * 1452)\n\
         told = AsyncSniffer(iface='c0', lfilter=lambda p: ICMP in p)\n\
         told.start()\n\
         time.sleep(0.5)\n\
         sendp(f, iface='c0', verbose=0)\n\
         time.sleep(1)\n\
         for p in told.stop():\n\
         \x20   print(p[Dot1Q].vlan, p[ICMP].type, p[ICMP].code, p[ICMP].nexthopmtu, p[IP].src)\n"
    );
    let out = lab.run(&lab.client, &[PYTHON, "-c", &send]);
    // 1500 less the tunnel (outer IPv4, UDP, VXLAN) and the tagged inner Ethernet header.
    assert_eq!(
        out.trim(),
        format!("200 3 4 1446 {SERVER}"),
        "{out}\n{}",
        lab.metrics()
    );
}

/// A routing hop: `dec ttl` both ways, the inside port with an `address`. Linux's
/// traceroute from the client (UDP probes of rising TTL, one at a time) names the gateway,
/// from the Time Exceeded it answers the first probe with, as hop 1, and the server as
/// hop 2.
#[test]
fn traceroute_names_the_gateway_as_a_hop() {
    let lab = Lab::for_driver("af_packet", "t");
    let dir = Scratch::new("live-traceroute");
    let pipe = dir.path("hop.pipe");
    std::fs::write(
        &pipe,
        format!(
            "pipeline hop\n\
             port inside  {{ driver af_packet  iface \"in0\"  address 10.77.0.254 }}\n\
             port outside {{ driver af_packet  iface \"out0\" }}\n\
             pipe out root from inside {{\n\
                 rule routed {{ match ipv4.dst {SERVER}  actions dec ttl, fwd outside }}\n\
                 default {{ actions drop }}\n\
             }}\n\
             pipe back root from outside {{\n\
                 rule routed {{ match ipv4.dst {CLIENT}  actions dec ttl, fwd inside }}\n\
                 default {{ actions drop }}\n\
             }}\n"
        ),
    )
    .expect("write pipeline");
    let _dpuflow = lab.start(&pipe, "1");
    let (hops, out) = traceroute(&lab, &lab.client, SERVER);
    assert_eq!(hops, ["10.77.0.254", SERVER], "{out}");
    // The counts are published every 100 ms: the last probes' may come after the first's.
    let series = "dpuflow_port_dropped_packets_total{port=\"inside\",reason=\"ttl_expired\"}";
    let sent = "dpuflow_port_transmitted_packets_total{port=\"inside\"}";
    let m = lab.metrics_until(
        |m| metric(m, sent).is_some_and(|n| n >= 2),
        "sent the message and the answer",
    );
    assert_eq!(metric(&m, series), Some(1), "{m}");
}

/// A routing VTEP: `dec ttl` after the decapsulation, the uplink with an address.
/// Linux's traceroute from the far side of the tunnel (the server, through its kernel's
/// vxlan device) names the gateway as hop 1, from the Time Exceeded it sends back
/// through the tunnel, which the server's vxlan device takes in, and the client as hop 2.
#[test]
fn traceroute_through_the_tunnel_names_the_gateway() {
    let (lab, _dir, pipe_path) = vxlan_lab("af_packet", "u", 1, "dec ttl,");
    let text = std::fs::read_to_string(&pipe_path).expect("read pipeline");
    let uplink = "iface \"out0\" }";
    let addressed = text.replace(uplink, "iface \"out0\"  address 192.0.2.1 }");
    assert_ne!(addressed, text);
    std::fs::write(&pipe_path, addressed).expect("write pipeline");
    let _dpuflow = lab.start(&pipe_path, "1");
    let (hops, out) = traceroute(&lab, &lab.server, CLIENT);
    assert_eq!(hops, ["192.0.2.1", CLIENT], "{out}");
}

/// Linux's traceroute from namespace `ns` to `to` (UDP probes of rising TTL, one at a
/// time, up to 4 hops): the address of each hop, and what it printed.
fn traceroute(lab: &Lab, ns: &str, to: &str) -> (Vec<String>, String) {
    let probe = ["-n", "-N", "1", "-q", "1", "-w", "2", "-m", "4", to];
    let out = lab.run(ns, &[&["traceroute"][..], &probe[..]].concat());
    // " 1  10.77.0.254  0.301 ms", after the heading.
    let hops = (out.lines().skip(1))
        .filter_map(|l| l.split_whitespace().nth(1).map(String::from))
        .collect();
    (hops, out)
}

/// A link going down and up again is survived (the port reads again). An interface
/// removed under its port closes the port (its socket would never see another frame: an
/// AF_XDP socket is not even told) and the rest carries on: frames for it are counted
/// unsent, `/readyz` says not ready, and once an interface of that name is made again the
/// port is opened on it and frames cross as before.
#[test]
fn a_removed_interface_is_opened_again_once_back() {
    // Two AF_PACKET workers each have a socket on the port (a fanout group), two AF_XDP
    // workers a queue each: the port closes and opens once, whichever socket goes or
    // comes first.
    for (driver, tag, workers, queues) in [
        ("af_packet", "rp", "1", 1),
        ("af_packet", "rs", "2", 1),
        ("af_xdp", "rx", "1", 1),
        ("af_xdp", "ry", "2", 2),
    ] {
        let (lab, _dir, pipe_path) = Lab::with_pipeline_queues(
            driver,
            tag,
            queues,
            // Only the test's frames: the hosts' own (IPv6 neighbour discovery as links
            // come up) would blur the counts.
            &format!(
                "{UDP_OUT}pipe back root from outside {{\n\
                     rule test {{ match eth.type 0x88b5  actions fwd inside }}\n\
                     default {{ actions drop }}\n\
                 }}\n"
            ),
        );
        let dpuflow = lab.start(&pipe_path, workers);
        lab.run(&lab.dut, &["ip", "link", "set", "in0", "down"]);
        lab.run(&lab.dut, &["ip", "link", "set", "in0", "up"]);
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            lab.ready(),
            "{driver}: not ready after a link went down and up"
        );
        let counter = lab.count_at_server(5003);
        lab.send_udp(5001, 5);
        let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
        lab.metrics_until(|m| metric(m, udp) == Some(5), "counted the first five");

        // The client's link goes, both ends.
        lab.run(&lab.dut, &["ip", "link", "del", "in0"]);
        let open = "dpuflow_port_open{port=\"inside\"}";
        lab.metrics_until(|m| metric(m, open) == Some(0), "closed the port");
        assert!(!lab.ready(), "{driver}: ready with a port closed");
        // Frames from outside for the closed port (not IP: the server's counter leaves
        // them out).
        let send = "from scapy.all import *\n\
                    sendp([Ether(src='02:00:00:00:00:02', dst='02:00:00:00:00:01', \
                    type=0x88b5)/Raw(b'x' * 50)] * 3, iface='s0', verbose=0)\n";
        lab.run(&lab.server, &[PYTHON, "-c", send]);
        let unsent = "dpuflow_port_unsent_packets_total{port=\"inside\"}";
        let m = lab.metrics_until(|m| metric(m, unsent) == Some(3), "counted 3 unsent");
        let tx = "dpuflow_port_transmitted_packets_total{port=\"outside\"}";
        assert_eq!(metric(&m, tx), Some(5), "{driver}: {m}");

        // Made again under the same name: the port opens on it.
        lab.link_inside_again(driver, queues);
        lab.send_udp(5003, 5);
        assert_eq!(counter.seen(), "5001:5 5003:5", "{driver}: what crossed");
        let m = lab.metrics_until(|m| metric(m, udp) == Some(10), "counted the last five");
        assert_eq!(metric(&m, tx), Some(10), "{driver}: {m}");
        let closed = "dpuflow_port_closed_total{port=\"inside\",reason=\"interface_removed\"}";
        assert_eq!(metric(&m, closed), Some(1), "{driver}: {m}");
        let log = stop(dpuflow);
        for said in ["interface removed", "live port open again"] {
            assert_eq!(
                log.matches(said).count(),
                1,
                "{driver}, {workers} worker(s): {said:?} once in the log:\n{log}"
            );
        }
    }
}

/// With `--wait-for-interfaces`, a port whose interface does not exist yet (a VF
/// representor before the host makes its VFs) does not fail the start: the service runs
/// its other ports, says not ready, and opens the port once an interface of that name
/// exists. Without the flag the start fails, naming the interface.
#[test]
fn an_interface_missing_at_the_start_is_waited_for() {
    for (driver, tag, workers) in [
        ("af_packet", "wp", "1"),
        ("af_packet", "ws", "2"),
        ("af_xdp", "wx", "1"),
        ("af_xdp", "wy", "2"),
    ] {
        let pipe =
            format!("{UDP_OUT}pipe back root from outside {{ default {{ actions drop }} }}\n");
        let (lab, dir, pipe_path) = Lab::with_pipeline_on(driver, tag, &pipe);
        lab.run(&lab.dut, &["ip", "link", "del", "in0"]);
        let (refused, said) = lab.run_once(&pipe_path);
        assert!(
            refused.code() == Some(2) && said.contains("interface in0: No such device"),
            "{driver}: {said}"
        );

        // Under systemd: ready once the workers run, the port awaited said in the status.
        let socket = dir.path("notify");
        let manager = Manager::bind(&socket);
        let env = format!("NOTIFY_SOCKET={socket}");
        let dpuflow = lab.start_serving(&[&env], &pipe_path, workers, &["--wait-for-interfaces"]);
        let first = manager.next();
        assert!(
            first.starts_with("READY=1\nSTATUS=running pipeline")
                && first.ends_with("; waiting for interface in0"),
            "{driver}: {first}"
        );
        let open = "dpuflow_port_open{port=\"inside\"}";
        let outside = "dpuflow_port_open{port=\"outside\"}";
        let m = lab.metrics_until(|m| metric(m, outside) == Some(1), "opened outside");
        assert_eq!(metric(&m, open), Some(0), "{driver}: {m}");
        std::thread::sleep(Duration::from_millis(300));
        assert!(!lab.ready(), "{driver}: ready with a port not open");

        lab.link_inside_again(driver, 1);
        let opened = manager.next();
        assert!(
            opened.starts_with("STATUS=running pipeline") && !opened.contains("waiting"),
            "{driver}: {opened}"
        );
        let counter = lab.count_at_server(5001);
        lab.send_udp(5001, 5);
        assert_eq!(counter.seen(), "5001:5", "{driver}: what crossed");
        let log = stop(dpuflow);
        for said in ["no such interface yet", "live port open iface=\"in0\""] {
            assert!(
                log.contains(said),
                "{driver}: {said:?} not in the log:\n{log}"
            );
        }
        // AF_XDP workers share a port by its receive queues, which a missing interface
        // has none of to count: the I/O thread deals, and says why.
        if driver == "af_xdp" && workers == "2" {
            let said = "interface in0 is not there, so its receive queues cannot be counted";
            assert!(log.contains(said), "{said:?} not in the log:\n{log}");
        }
    }
}

/// The wall clock stepped (NTP or PTP setting a clock that was wrong, as a DPU's often is
/// at boot) does not move connection timeouts: a connection made after the clock went
/// back an hour is not ended by the next sweep, and one the clock then jumps two hours
/// past is not ended either (Linux's conntrack counts in jiffies for the same reason).
/// The flow records exported after the steps carry the wall clock as it then stands.
/// libfaketime steps the service's clock alone, not the machine's.
#[test]
fn a_stepped_wall_clock_ends_no_connection() {
    let faketime = ["x86_64", "aarch64"]
        .map(|arch| format!("/usr/lib/{arch}-linux-gnu/faketime/libfaketime.so.1"))
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect("libfaketime is required (scripts/test installs it)");
    let (lab, dir, pipe_path) = Lab::with_pipeline(
        "t",
        "conntrack { timeout udp 30s }\n\
         pipe out root from inside {\n\
             rule udp { match ip.proto 17  actions ct.commit, fwd outside }\n\
             default { actions drop }\n\
         }\n\
         pipe back root from outside {\n\
             rule tracked { match ct.state established  actions fwd inside }\n\
             default { actions drop }\n\
         }\n",
    );
    let offset = dir.path("offset");
    std::fs::write(&offset, "+0\n").expect("offset");
    let env = [
        format!("LD_PRELOAD={faketime}"),
        format!("FAKETIME_TIMESTAMP_FILE={offset}"),
        "FAKETIME_NO_CACHE=1".to_owned(),
        "FAKETIME_DONT_FAKE_MONOTONIC=1".to_owned(),
    ];
    let env: Vec<&str> = env.iter().map(String::as_str).collect();
    let collector = Watcher::start(&lab.dut, FLOW_TIMES);
    let dpuflow = lab.start_with(&env, &pipe_path, "1", &["--ipfix", "127.0.0.1:4739"]);
    let entries = "dpuflow_conntrack_entries";
    lab.send_udp(5001, 1);
    lab.metrics_until(|m| metric(m, entries) == Some(1), "tracked the first");
    std::fs::write(&offset, "-3600\n").expect("offset");
    std::thread::sleep(Duration::from_millis(300));
    lab.send_udp(5002, 1);
    lab.metrics_until(|m| metric(m, entries) == Some(2), "tracked the second");
    // Sweeps run every tenth of a second while the ports are quiet.
    std::thread::sleep(Duration::from_millis(500));
    std::fs::write(&offset, "+3600\n").expect("offset");
    std::thread::sleep(Duration::from_millis(500));
    // The server answers the second: its reply is of a tracked connection.
    let reply = format!(
        "from scapy.all import *\n\
         sendp(Ether(src='02:00:00:00:00:02', dst='02:00:00:00:00:01')/\
         IP(src='{SERVER}', dst='{CLIENT}')/UDP(sport=5002, dport=4000), iface='s0', verbose=0)\n"
    );
    lab.run(&lab.server, &[PYTHON, "-c", &reply]);
    let tracked = "dpuflow_rule_matched_packets_total{pipe=\"back\",rule=\"tracked\"}";
    let m = lab.metrics_until(|m| metric(m, tracked) == Some(1), "let the reply in");
    assert_eq!(metric(&m, entries), Some(2), "{m}");
    assert_eq!(
        metric(&m, "dpuflow_conntrack_expirations_total"),
        Some(0),
        "{m}"
    );
    stop(dpuflow);
    let line = collector.interrupt();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let seen: Vec<f64> = line
        .split_whitespace()
        .map(|t| t.parse().expect("a time"))
        .collect();
    assert!(!seen.is_empty(), "no flow record reached the collector");
    for t in seen {
        let ahead = t - now;
        assert!(
            (3540.0..3660.0).contains(&ahead),
            "a flow time {ahead:.1} s from now, where the service's clock is an hour ahead"
        );
    }
}

/// A collector on 127.0.0.1:4739 that decodes IPFIX data records by their templates and,
/// once interrupted (or after two minutes), prints every record's flowStartMilliseconds and
/// flowEndMilliseconds (IEs 152 and 153, RFC 7011 §3, RFC 5102) in seconds.
const FLOW_TIMES: &str = r#"
import socket, struct, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 4739))
s.settimeout(0.5)
end = time.time() + 120
print("listening", flush=True)
templates, times = {}, []
def read(m):
    at = 16
    while at + 4 <= len(m):
        sid, slen = struct.unpack("!HH", m[at:at + 4])
        body, at = m[at + 4:at + slen], at + slen
        if sid == 2:
            i = 0
            while i + 4 <= len(body):
                tid, n = struct.unpack("!HH", body[i:i + 4]); i += 4
                fields = []
                for _ in range(n):
                    ie, ln = struct.unpack("!HH", body[i:i + 4]); i += 4
                    if ie & 0x8000:
                        i += 4
                    fields.append((ie & 0x7fff, ln))
                templates[tid] = fields
        elif sid >= 256 and sid in templates:
            fields = templates[sid]
            size = sum(ln for _, ln in fields)
            for r in range(0, len(body) - size + 1, size):
                i = r
                for ie, ln in fields:
                    if ie in (152, 153):
                        times.append(int.from_bytes(body[i:i + ln], "big") / 1000)
                    i += ln
try:
    while time.time() < end:
        try:
            read(s.recv(65535))
        except socket.timeout:
            pass
except KeyboardInterrupt:
    pass
print(" ".join("%.3f" % t for t in times), flush=True)
"#;

/// Time passes on live ports without packets: a UDP connection (timeout 1 s) ends with no
/// packet after its last, and the counts of the last packets reach the metrics without
/// more traffic behind them.
#[test]
fn idle_connections_end_without_traffic() {
    let (lab, _dir, pipe_path) = Lab::with_pipeline(
        "i",
        "conntrack { timeout udp 1s }\n\
         pipe out root from inside {\n\
             rule udp { match ip.proto 17  actions ct.commit, fwd outside }\n\
             default { actions drop }\n\
         }\n",
    );
    let _dpuflow = lab.start(&pipe_path, "1");
    lab.send_udp(5000, 1);
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    let m = lab.metrics_until(|m| metric(m, udp) == Some(1), "counted the datagram");
    assert_eq!(metric(&m, "dpuflow_conntrack_entries"), Some(1), "{m}");
    let m = lab.metrics_until(
        |m| metric(m, "dpuflow_conntrack_entries") == Some(0),
        "ended the idle connection",
    );
    assert_eq!(
        metric(&m, "dpuflow_conntrack_expirations_total"),
        Some(1),
        "{m}"
    );
}

/// A link that goes down and comes back: frames for it meanwhile are dropped (counted as
/// unwritten, and said in the log), the service carries on, and frames cross again once
/// the link is up.
#[test]
fn a_port_whose_link_goes_down_carries_on() {
    link_down_and_up("af_packet", "l");
}

#[test]
fn an_af_xdp_port_whose_link_goes_down_carries_on() {
    link_down_and_up("af_xdp", "m");
}

fn link_down_and_up(driver: &str, tag: &str) {
    let (lab, _dir, pipe_path) = Lab::with_pipeline_on(driver, tag, UDP_OUT);
    let _dpuflow = lab.start(&pipe_path, "1");
    let counter = lab.count_at_server(5003);
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    lab.send_udp(5001, 5);
    lab.metrics_until(|m| metric(m, udp) == Some(5), "counted the first five");
    lab.run(&lab.dut, &["ip", "link", "set", "out0", "down"]);
    lab.send_udp(5002, 5);
    lab.metrics_until(|m| metric(m, udp) == Some(10), "counted five more");
    lab.run(&lab.dut, &["ip", "link", "set", "out0", "up"]);
    // The kernel passes frames once the link is up and its queue is back (which it does
    // after a second or so).
    let deadline = Instant::now() + Duration::from_secs(5);
    while lab
        .run(&lab.dut, &["cat", "/sys/class/net/out0/operstate"])
        .trim()
        != "up"
    {
        assert!(Instant::now() < deadline, "out0 never came back up");
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
    lab.send_udp(5003, 5);
    assert_eq!(counter.seen(), "5001:5 5003:5", "what crossed");
    let m = lab.metrics_until(|m| metric(m, udp) == Some(15), "counted the last five");
    let sent = "dpuflow_port_transmitted_packets_total{port=\"outside\"}";
    assert_eq!(metric(&m, sent), Some(15), "{m}");
    let unsent = "dpuflow_port_unsent_packets_total{port=\"outside\"}";
    assert_eq!(metric(&m, unsent), Some(5), "the five sent while down: {m}");
}

/// The VXLAN gateway on live ports, with the Linux kernel's `vxlan` driver as the far
/// VTEP: the client's frames to the server's overlay address are encapsulated by dpuflow
/// towards the server's underlay address, where a kernel vxlan device takes them in; the
/// server's replies, encapsulated by the kernel, are decapsulated by dpuflow back to the
/// client. Pings and a 1 MB HTTP fetch cross both ways.
#[test]
fn the_vxlan_gateway_talks_to_the_kernels_vxlan_over_af_packet() {
    vxlan_gateway_to_the_kernel("af_packet", "g", "2", 1);
}

/// The same over AF_XDP, with one worker (run by the I/O thread).
#[test]
fn the_vxlan_gateway_talks_to_the_kernels_vxlan_over_af_xdp() {
    vxlan_gateway_to_the_kernel("af_xdp", "h", "1", 1);
}

/// And with two workers on links of two queues: each worker reads and sends through a
/// queue of its own on each link.
#[test]
fn the_vxlan_gateway_talks_to_the_kernels_vxlan_over_af_xdp_queues_of_two_workers() {
    vxlan_gateway_to_the_kernel("af_xdp", "j", "2", 2);
}

/// The server's vxlan device's MAC address, and its IPv6 address in the overlay
/// (the client's is [`CLIENT6`]).
const VXLAN_MAC: &str = "02:00:00:00:02:02";
const SERVER6: &str = "fd00:77::2";
const CLIENT6: &str = "fd00:77::1";

/// The client, the gateway and a server behind a kernel vxlan device (VNI 100, VTEP
/// 192.0.2.10; the gateway's 192.0.2.1): the lab, its scratch directory and the gateway's
/// pipeline file, ports `inside` and `outside` on `driver`; `also` (actions) goes before
/// each encapsulation and after the decapsulation.
fn vxlan_lab(driver: &str, tag: &str, queues: u16, also: &str) -> (Lab, Scratch, String) {
    let lab = Lab::for_driver_with_queues(driver, tag, queues);
    let (client_mac, underlay_mac) = (lab.mac(&lab.client, "c0"), lab.mac(&lab.server, "s0"));
    // The server: underlay 192.0.2.10 on its link, the overlay address on a vxlan device
    // whose remote VTEP is the gateway's 192.0.2.1.
    lab.behind_vxlan(&lab.server, "s0", "192.0.2.10", SERVER, 100, VXLAN_MAC);
    let s = |args: &[&str]| lab.run(&lab.server, args);
    s(&[
        "ip",
        "neigh",
        "replace",
        CLIENT,
        "lladdr",
        &client_mac,
        "dev",
        "vxlan0",
        "nud",
        "permanent",
    ]);
    lab.run(
        &lab.client,
        &[
            "ip",
            "neigh",
            "replace",
            SERVER,
            "lladdr",
            VXLAN_MAC,
            "dev",
            "c0",
            "nud",
            "permanent",
        ],
    );
    let dir = Scratch::new(&format!("live-vxlan-{driver}-{tag}"));
    let pipe_path = dir.path("gateway.pipe");
    std::fs::write(
        &pipe_path,
        format!(
            "pipeline gateway\n\
             port inside  {{ driver {driver}  iface \"in0\" }}\n\
             port outside {{ driver {driver}  iface \"out0\" }}\n\
             pipe encap root from inside {{\n\
                 rule to_server {{\n\
                     match ipv4.dst {SERVER}\n\
                     actions {also} vxlan.encap {{ vni 100  src 192.0.2.1  dst 192.0.2.10\n\
                                            smac 02:00:00:00:01:01  dmac {underlay_mac} }},\n\
                             fwd outside\n\
                 }}\n\
                 rule to_server6 {{\n\
                     match ipv6.dst {SERVER6}\n\
                     actions {also} vxlan.encap {{ vni 100  src 192.0.2.1  dst 192.0.2.10\n\
                                            smac 02:00:00:00:01:01  dmac {underlay_mac} }},\n\
                             fwd outside\n\
                 }}\n\
                 default {{ actions drop }}\n\
             }}\n\
             pipe decap root from outside {{\n\
                 rule vni100 {{ match udp.dst 4789  vxlan.vni 100  actions vxlan.decap, {also} fwd inside }}\n\
                 default {{ actions drop }}\n\
             }}\n"
        ),
    )
    .expect("write pipeline");
    (lab, dir, pipe_path)
}

fn vxlan_gateway_to_the_kernel(driver: &str, tag: &str, workers: &str, queues: u16) {
    let (lab, dir, pipe_path) = vxlan_lab(driver, tag, queues, "");
    let body: Vec<u8> = (0..1_000_000u32).map(|i| (i * 13 % 251) as u8).collect();
    std::fs::write(dir.0.join("file.bin"), &body).expect("write file");
    let _server = lab.serve(&lab.server, SERVER, "80", &dir);
    let dpuflow = lab.start(&pipe_path, workers);
    assert!(lab.ping(&lab.client, SERVER), "no ping through the gateway");
    lab.fetch_whole_file("5", body.len(), "no HTTP connection through the gateway");
    // The megabyte in segments of at most 1410 bytes (the vxlan device's MTU, 1450, less
    // the IP and TCP headers), and the client's side: its SYN, request and ACKs.
    let (out, back) = (
        "dpuflow_rule_matched_packets_total{pipe=\"encap\",rule=\"to_server\"}",
        "dpuflow_rule_matched_packets_total{pipe=\"decap\",rule=\"vni100\"}",
    );
    lab.metrics_until(
        |m| metric(m, out).unwrap_or(0) >= 10 && metric(m, back).unwrap_or(0) >= 700,
        "counted both ways",
    );
    let log = stop(dpuflow);
    if queues > 1 {
        let shared = format!("mode={queues} queue(s) shared by {workers} workers");
        assert!(log.contains(&shared), "{log}");
    }
}

impl Lab {
    /// Puts host `ns`'s overlay address `overlay` on a vxlan device, `vxlan0`, of VNI
    /// `vni` and MAC `mac`, whose remote VTEP is the gateway's 192.0.2.1 (MAC
    /// 02:00:00:00:01:01); its link `link` takes the underlay address `underlay`
    /// instead. Over AF_PACKET the host leaves its checksums to hardware, the inner one
    /// of each encapsulated segment included, and the port finishes them where the
    /// kernel says (over AF_XDP the hosts finish their own: see `Lab::for_driver`).
    fn behind_vxlan(
        &self,
        ns: &str,
        link: &str,
        underlay: &str,
        overlay: &str,
        vni: u32,
        mac: &str,
    ) {
        let run = |args: &[&str]| self.run(ns, args);
        run(&["ip", "addr", "flush", "dev", link]);
        run(&["ip", "addr", "add", &format!("{underlay}/24"), "dev", link]);
        let gateway = ["192.0.2.1", "lladdr", "02:00:00:00:01:01", "dev", link];
        run(&[
            &["ip", "neigh", "replace"][..],
            &gateway,
            &["nud", "permanent"],
        ]
        .concat());
        let vni = vni.to_string();
        let device = ["vxlan0", "address", mac, "type", "vxlan", "id", &vni];
        let ends = [
            "local",
            underlay,
            "remote",
            "192.0.2.1",
            "dstport",
            "4789",
            "dev",
            link,
        ];
        run(&[&["ip", "link", "add"][..], &device, &ends].concat());
        run(&["ip", "link", "set", "vxlan0", "up"]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{overlay}/24"),
            "dev",
            "vxlan0",
        ]);
    }

    /// The server's vxlan device carries 1500-byte packets (its link 1550), so it asks
    /// the client for full-sized segments (MSS 1460, 1440 over IPv6); IPv6 beside IPv4 in
    /// the overlay, neighbours known (no discovery through the gateway, which forwards
    /// only what its rules name).
    fn full_sized_overlay(&self) {
        self.run(&self.server, &["ip", "link", "set", "s0", "mtu", "1550"]);
        self.run(
            &self.server,
            &["ip", "link", "set", "vxlan0", "mtu", "1500"],
        );
        let client_mac = self.mac(&self.client, "c0");
        for (ns, dev, me, peer, mac) in [
            (&self.client, "c0", CLIENT6, SERVER6, VXLAN_MAC),
            (
                &self.server,
                "vxlan0",
                SERVER6,
                CLIENT6,
                client_mac.as_str(),
            ),
        ] {
            let me = format!("{me}/64");
            self.run(ns, &["ip", "-6", "addr", "add", &me, "dev", dev, "nodad"]);
            let neigh = [
                "ip", "-6", "neigh", "replace", peer, "lladdr", mac, "dev", dev,
            ];
            self.run(ns, &[&neigh[..], &["nud", "permanent"]].concat());
        }
    }

    /// The client sends a megabyte over TCP to `server` (of socket family `family`),
    /// which counts it all; the client's route to it after.
    fn upload(&self, family: &str, server: &str) -> String {
        let sink = Watcher::start(
            &self.server,
            &format!(
                r#"
import socket
s = socket.create_server(("{server}", 9000), family=socket.{family})
print("listening", flush=True)
c, _ = s.accept()
n = 0
while True:
    b = c.recv(65536)
    if not b:
        break
    n += len(b)
c.sendall(str(n).encode())
c.close()
print(n, flush=True)
"#
            ),
        );
        let upload = format!(
            r#"
import socket
c = socket.create_connection(("{server}", 9000), timeout=20)
c.sendall(bytes(range(250)) * 4000)
c.shutdown(socket.SHUT_WR)
print(c.recv(100).decode())
"#
        );
        let sent = self.run(&self.client, &[PYTHON, "-c", &upload]);
        assert_eq!(sent.trim(), "1000000", "the server's count over {family}");
        assert_eq!(sink.seen(), "1000000");
        self.run(&self.client, &["ip", "route", "get", server])
    }
}

const TOLD: &str = "dpuflow_port_dropped_packets_total{port=\"inside\",reason=\"packet_too_big\"}";

/// [`vxlan_lab`] over AF_PACKET with [`Lab::full_sized_overlay`], the gateway running
/// with one worker and a ping through it answered.
fn full_sized_gateway(tag: &str, also: &str) -> (Lab, Scratch, Running) {
    let (lab, dir, pipe_path) = vxlan_lab("af_packet", tag, 1, also);
    lab.full_sized_overlay();
    let dpuflow = lab.start(&pipe_path, "1");
    assert!(lab.ping(&lab.client, SERVER), "no ping through the gateway");
    (lab, dir, dpuflow)
}

/// A client whose link's MTU is the gateway's uplink's, talking to a server that takes
/// full-sized segments: its full-sized packets no longer fit once encapsulated. The
/// gateway tells it the MTU inside the tunnel (ICMP Fragmentation Needed, RFC 1191), the
/// client's kernel takes it (its route to the server learns MTU 1450) and sends smaller
/// segments, and a megabyte crosses, where it would otherwise stall at the first
/// full-sized segment; and the same over IPv6 (ICMPv6 Packet Too Big, RFC 8201).
#[test]
fn the_vxlan_gateway_tells_a_host_the_mtu_inside_the_tunnel() {
    let (lab, _dir, dpuflow) = full_sized_gateway("m", "");
    for (family, server) in [("AF_INET", SERVER), ("AF_INET6", SERVER6)] {
        let route = lab.upload(family, server);
        assert!(route.contains("mtu 1450"), "the client's route: {route}");
    }
    lab.metrics_until(|m| metric(m, TOLD).unwrap_or(0) >= 2, "told the client");
    stop(dpuflow);
}

/// A gateway carrying an overlay from one VNI into another: the client behind its
/// kernel's vxlan device in VNI 100, the server behind its own in VNI 200, both devices
/// carrying 1550-byte packets (links of 1600), and the fabric on the server's side
/// 1500 bytes (the gateway's `outside` port). The client's full-sized packets no longer
/// fit once in VNI 200: the gateway tells it the MTU inside that tunnel, through VNI
/// 100, the client's kernel takes the message from its vxlan device (its route to the
/// server learns MTU 1450), and a megabyte crosses.
#[test]
fn a_gateway_between_two_vnis_tells_a_host_the_mtu_through_its_own() {
    let lab = Lab::for_driver("af_packet", "w");
    let under = [lab.mac(&lab.client, "c0"), lab.mac(&lab.server, "s0")];
    for (ns, link, dut_end) in [(&lab.client, "c0", "in0"), (&lab.server, "s0", "out0")] {
        lab.run(ns, &["ip", "link", "set", link, "mtu", "1600"]);
        lab.run(&lab.dut, &["ip", "link", "set", dut_end, "mtu", "1600"]);
    }
    const CLIENT_VXLAN_MAC: &str = "02:00:00:00:02:01";
    let vteps = [
        (
            &lab.client,
            "c0",
            "192.0.2.20",
            CLIENT,
            100,
            CLIENT_VXLAN_MAC,
        ),
        (&lab.server, "s0", "192.0.2.10", SERVER, 200, VXLAN_MAC),
    ];
    for (i, &(ns, link, underlay, overlay, vni, mac)) in vteps.iter().enumerate() {
        lab.behind_vxlan(ns, link, underlay, overlay, vni, mac);
        lab.run(ns, &["ip", "link", "set", "vxlan0", "mtu", "1550"]);
        let (peer, peer_mac) = (vteps[1 - i].3, vteps[1 - i].5);
        let neigh = ["ip", "neigh", "replace", peer, "lladdr", peer_mac];
        lab.run(
            ns,
            &[&neigh[..], &["dev", "vxlan0", "nud", "permanent"]].concat(),
        );
    }
    let dir = Scratch::new("live-two-vnis");
    let pipe_path = dir.path("stitch.pipe");
    std::fs::write(
        &pipe_path,
        format!(
            "pipeline stitch\n\
             port inside  {{ driver af_packet  iface \"in0\"  mtu 1600 }}\n\
             port outside {{ driver af_packet  iface \"out0\"  mtu 1500 }}\n\
             pipe from_client root from inside {{\n\
                 rule vni100 {{ match udp.dst 4789  vxlan.vni 100\n\
                     actions vxlan.decap, vxlan.encap {{ vni 200  src 192.0.2.1  dst 192.0.2.10\n\
                         smac 02:00:00:00:01:01  dmac {} }}, fwd outside }}\n\
                 default {{ actions drop }}\n\
             }}\n\
             pipe from_server root from outside {{\n\
                 rule vni200 {{ match udp.dst 4789  vxlan.vni 200\n\
                     actions vxlan.decap, vxlan.encap {{ vni 100  src 192.0.2.1  dst 192.0.2.20\n\
                         smac 02:00:00:00:01:01  dmac {} }}, fwd inside }}\n\
                 default {{ actions drop }}\n\
             }}\n",
            under[1], under[0]
        ),
    )
    .expect("write pipeline");
    let dpuflow = lab.start(&pipe_path, "1");
    assert!(lab.ping(&lab.client, SERVER), "no ping through the gateway");
    let route = lab.upload("AF_INET", SERVER);
    assert!(route.contains("mtu 1450"), "the client's route: {route}");
    lab.metrics_until(|m| metric(m, TOLD).unwrap_or(0) >= 1, "told the client");
    stop(dpuflow);
}

/// The same client and server, the gateway clamping the MSS of SYNs both ways to what
/// fits the tunnel (`clamp tcp.mss mtu`: the tunnel's 1450 less the IPv4 and TCP
/// headers, 1410, or the IPv6 and TCP ones, 1390; the server's SYN-ACK is what tells the
/// client how much to send): the client never sends what would not fit, so nobody is
/// told anything and its routes learn no MTU.
#[test]
fn a_clamped_mss_keeps_a_hosts_segments_inside_the_tunnel() {
    let (lab, _dir, dpuflow) = full_sized_gateway("n", "clamp tcp.mss mtu,");
    for (family, server) in [("AF_INET", SERVER), ("AF_INET6", SERVER6)] {
        let route = lab.upload(family, server);
        assert!(!route.contains("mtu"), "the client's route: {route}");
    }
    assert_eq!(metric(&lab.metrics(), TOLD), Some(0));
    stop(dpuflow);
}

/// A fabric that marks congestion rather than drop: the server's link marks Congestion
/// Experienced on every tunnelled packet that is ECN-capable outside, both ways
/// (nftables, as a switch's queue would). The client's TCP asks for ECN (`tcp_ecn=1`).
/// Uploading, its segments leave the gateway ECT(0) outside, so they are marked, the
/// kernel's vxlan device carries the mark inside and the server echoes it (the client's
/// `TCPDeliveredCE` rises); downloading, the gateway carries inside the marks the fabric
/// put on the server's tunnel (RFC 6040), and the client echoes them (the server's
/// rises). Without either half, neither count moves (checked against the build before).
#[test]
fn congestion_marks_cross_the_vxlan_gateway_both_ways() {
    let (lab, dir, pipe_path) = vxlan_lab("af_packet", "e", 1, "");
    lab.run(&lab.client, &["sysctl", "-qw", "net.ipv4.tcp_ecn=1"]);
    let marking = dir.path("marking.nft");
    std::fs::write(
        &marking,
        "table netdev fabric {\n\
             chain towards_server {\n\
                 type filter hook ingress device s0 priority 0;\n\
                 udp dport 4789 ip ecn ect0 counter ip ecn set ce\n\
             }\n\
             chain towards_gateway {\n\
                 type filter hook egress device s0 priority 0;\n\
                 udp dport 4789 ip ecn ect0 counter ip ecn set ce\n\
             }\n\
         }\n",
    )
    .expect("write the ruleset");
    lab.run(&lab.server, &["nft", "-f", &marking]);
    let dpuflow = lab.start(&pipe_path, "1");
    assert!(lab.ping(&lab.client, SERVER), "no ping through the gateway");

    lab.upload("AF_INET", SERVER);
    let echoed = delivered_ce(&lab, &lab.client);
    assert!(
        echoed > 0,
        "the server echoed no mark of the client's segments"
    );

    let body = vec![7u8; 1_000_000];
    std::fs::write(dir.0.join("file.bin"), &body).expect("write file");
    let _http = lab.serve(&lab.server, SERVER, "80", &dir);
    lab.fetch_whole_file("10", body.len(), "no HTTP connection through the gateway");
    let echoed = delivered_ce(&lab, &lab.server);
    assert!(
        echoed > 0,
        "the client echoed no mark of the server's segments"
    );

    let counters = lab.run(&lab.server, &["nft", "list", "table", "netdev", "fabric"]);
    let marked: Vec<u64> = counters
        .split("counter packets ")
        .skip(1)
        .map(|c| {
            c.split(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .expect("a count")
        })
        .collect();
    assert!(
        marked.len() == 2 && marked.iter().all(|&n| n > 0),
        "{counters}"
    );
    let not_ect = "dpuflow_port_dropped_packets_total{port=\"outside\",reason=\"ecn_not_ect\"}";
    let marked = "dpuflow_port_congestion_marked_packets_total{port=\"outside\"}";
    let m = lab.metrics_until(
        |m| metric(m, marked).unwrap_or(0) > 0,
        "the marks carried inside counted",
    );
    assert_eq!(metric(&m, not_ect), Some(0));
    stop(dpuflow);
}

/// Segments of `ns`'s connections its peer acknowledged with ECN-Echo set (Linux's
/// `TcpExt: TCPDeliveredCE`).
fn delivered_ce(lab: &Lab, ns: &str) -> u64 {
    let netstat = lab.run(ns, &["cat", "/proc/net/netstat"]);
    let mut lines = netstat.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next().expect("names"), lines.next().expect("values"));
    let at = names
        .split_whitespace()
        .position(|n| n == "TCPDeliveredCE")
        .expect("TCPDeliveredCE");
    values
        .split_whitespace()
        .nth(at)
        .expect("a value")
        .parse()
        .expect("a count")
}

/// An af_xdp port's XDP program is dpuflow's while it runs and goes with it, however it
/// ends: a second service on the same interface is refused while the first runs, and
/// after the first is killed (SIGKILL: no clean-up of its own) the interface has no
/// program left.
#[test]
fn the_xdp_program_goes_with_the_service() {
    let (lab, _dir, pipe_path) = Lab::with_pipeline_on(
        "af_xdp",
        "p",
        "pipe out root from inside { default { actions fwd outside } }\n",
    );
    let xdp = |iface: &str| {
        lab.run(&lab.dut, &["ip", "link", "show", iface])
            .contains("prog/xdp")
    };
    assert!(!xdp("in0"));
    let mut first = lab.start(&pipe_path, "1");
    assert!(xdp("in0") && xdp("out0"), "no XDP program attached");
    let bin = env!("CARGO_BIN_EXE_dpuflow");
    let second = Command::new("ip")
        .args(["netns", "exec", &lab.dut, bin, "run", &pipe_path])
        .args(["--metrics", "127.0.0.1:0"])
        .output()
        .expect("second dpuflow");
    let err = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(2), "{err}");
    assert!(
        err.contains("interface in0: AF_XDP socket:")
            && err.contains("(another XDP program or AF_XDP socket is on the interface)"),
        "{err}"
    );
    first.0.kill().expect("SIGKILL");
    first.0.wait().expect("wait");
    let deadline = Instant::now() + Duration::from_secs(5);
    while xdp("in0") || xdp("out0") {
        assert!(
            Instant::now() < deadline,
            "an XDP program outlived the service"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The systemd unit's capabilities (deploy/systemd/dpuflow.service) open both kinds of
/// live port for a user that is not root, and each of CAP_NET_RAW, CAP_NET_ADMIN and
/// CAP_BPF is needed: without it the service refuses to start, naming the port.
#[test]
fn the_units_capabilities_open_live_ports_and_each_is_needed() {
    let (lab, dir, pipe_path) = Lab::with_pipeline_on(
        "af_xdp",
        "u",
        "pipe out root from inside { default { actions fwd outside } }\n",
    );
    // The second port on AF_PACKET.
    let text = std::fs::read_to_string(&pipe_path).expect("pipeline");
    let text = text.replacen(
        "port outside { driver af_xdp",
        "port outside { driver af_packet",
        1,
    );
    std::fs::write(&pipe_path, text).expect("write pipeline");
    let unit = std::fs::read_to_string("deploy/systemd/dpuflow.service").expect("unit");
    let caps: Vec<String> = unit
        .lines()
        .find_map(|l| l.strip_prefix("AmbientCapabilities="))
        .expect("AmbientCapabilities")
        .split_whitespace()
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let bin = env!("CARGO_BIN_EXE_dpuflow");
    let run_as_nobody = |caps: &[&String], pipe: &str, extra: &[&str]| {
        let set = std::iter::once("-all".to_owned())
            .chain(
                caps.iter()
                    .map(|c| format!("+{}", c.trim_start_matches("cap_"))),
            )
            .collect::<Vec<_>>()
            .join(",");
        Command::new("ip")
            .args(["netns", "exec", &lab.dut, "setpriv"])
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args([
                format!("--inh-caps={set}"),
                format!("--ambient-caps={set}"),
                format!("--bounding-set={set}"),
            ])
            .args([bin, "run", pipe, "--metrics", "127.0.0.1:9464"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("setpriv (util-linux)")
    };
    let run_with = |caps: &[&String]| run_as_nobody(caps, &pipe_path, &[]);
    let all: Vec<&String> = caps.iter().collect();
    let dpuflow = Running(run_with(&all));
    let m = lab.metrics_until(|m| m.contains("dpuflow_build_info"), "serving as nobody");
    assert!(
        m.contains("dpuflow_port_received_packets_total{port=\"inside\"}"),
        "{m}"
    );
    drop(dpuflow);
    for needed in ["cap_net_raw", "cap_net_admin", "cap_bpf"] {
        let fewer: Vec<&String> = caps.iter().filter(|c| *c != needed).collect();
        assert!(fewer.len() < caps.len(), "the unit lacks {needed}");
        let out = run_with(&fewer).wait_with_output().expect("dpuflow");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "without {needed}: {err}");
        assert!(
            err.contains("interface in0: AF_XDP socket: Operation not permitted"),
            "without {needed}: {err}"
        );
    }
    // Connections tracked by two workers on AF_PACKET ports: the kernel steers each
    // port's frames to them by a program the unit's capabilities load; without CAP_BPF the
    // I/O thread deals them, and says why.
    let firewall = dir.path("firewall.pipe");
    let example = std::fs::read_to_string("pipelines/stateful-firewall.pipe").expect("example");
    let example = example
        .replace("iface \"pf0hpf\"", "iface \"in0\"")
        .replace("iface \"p0\"", "iface \"out0\"")
        .replace("capacity 1000000", "capacity 10000");
    std::fs::write(&firewall, example).expect("write pipeline");
    let no_bpf: Vec<&String> = caps.iter().filter(|c| *c != "cap_bpf").collect();
    for (caps, said) in [
        (&all, "steered by a program of the dealer's choice"),
        (
            &no_bpf,
            "the kernel refused the program that steers them there (Operation not permitted",
        ),
    ] {
        let dpuflow = Running(run_as_nobody(caps, &firewall, &["--workers", "2"]));
        lab.metrics_until(|m| m.contains("dpuflow_build_info"), "serving as nobody");
        let log = stop(dpuflow);
        assert!(log.contains(said), "{log}");
    }
}

/// An interface of several receive queues: the port has a socket on each, so frames of
/// many flows, which the veth spreads over its four queues, all reach the pipeline (a
/// queue without a socket would hand its frames to the dut's kernel instead). With two
/// workers, each reads and sends through two queues of its own.
#[test]
fn every_queue_of_an_af_xdp_port_is_read() {
    let (lab, _dir, pipe_path) = Lab::with_pipeline_queues("af_xdp", "n", 4, UDP_OUT);
    let dpuflow = lab.start(&pipe_path, "2");
    lab.send_udp_flows(5000, 2000, 64);
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    let sent = "dpuflow_port_transmitted_packets_total{port=\"outside\"}";
    let m = lab.metrics_until(
        |m| metric(m, udp) == Some(2000) && metric(m, sent) == Some(2000),
        "read and sent all 2000",
    );
    assert_eq!(metric(&m, udp), Some(2000), "{m}");
    let log = stop(dpuflow);
    for said in [
        "live port open iface=\"in0\" driver=\"AF_XDP\" mode=4 queue(s) shared by 2 workers, copy",
        "each worker reads and sends its own share of the live ports",
    ] {
        assert!(log.contains(said), "{said:?} not in the log:\n{log}");
    }
}

/// Two workers on AF_PACKET ports, with no connections to track: each reads and sends its
/// own share of each port through a socket of its own in the port's fanout group, the
/// kernel dealing the frames by flow. Every datagram of many flows crosses once: none lost
/// to the hand-over, none twice (a socket joining its group takes nothing before); and a
/// reload reaches every worker. With `--cpus`, each worker runs on a CPU of the list.
#[test]
fn workers_read_and_send_their_own_shares_of_a_port() {
    let (lab, _dir, pipe_path) = Lab::with_pipeline("sh", UDP_OUT);
    let dpuflow = lab.start_with(&[], &pipe_path, "2", &["--cpus", "0-1"]);
    // No I/O thread: each worker on a CPU of the list.
    let placed = thread_cpus(dpuflow.0.id());
    assert_eq!(
        placed.get("worker-0").map(String::as_str),
        Some("0"),
        "{placed:?}"
    );
    assert_eq!(
        placed.get("worker-1").map(String::as_str),
        Some("1"),
        "{placed:?}"
    );
    assert!(!placed.contains_key("io"), "{placed:?}");
    let m = lab.udp_crosses_once();
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    let sent = "dpuflow_port_transmitted_packets_total{port=\"outside\"}";
    let open = "dpuflow_port_open{port=\"inside\"}";
    assert_eq!(metric(&m, open), Some(1), "{m}");
    // A reload reaches both workers: after it, neither forwards the client's UDP.
    let text = std::fs::read_to_string(&pipe_path).expect("read pipeline");
    let dropping = text.replace("actions fwd outside", "actions drop");
    std::fs::write(&pipe_path, dropping).expect("write pipeline");
    tool_ok("kill", &["-HUP", &dpuflow.0.id().to_string()]);
    let reloads = "dpuflow_pipeline_reloads_total{result=\"success\"}";
    lab.metrics_until(|m| metric(m, reloads) == Some(1), "reloaded");
    lab.send_udp_flows(5001, 100, 64);
    let m = lab.metrics_until(|m| metric(m, udp) == Some(705), "counted 100 more");
    assert_eq!(
        metric(&m, sent),
        Some(605),
        "forwarded after the reload: {m}"
    );
    let log = stop(dpuflow);
    assert!(
        log.contains("each worker reads and sends its own share"),
        "{log}"
    );
    assert_eq!(
        log.matches("live port open iface=\"in0\"").count(),
        1,
        "{log}"
    );
}

/// `--busy-poll`: every frame crosses once, and the dataplane's threads spin rather than
/// sleep (their CPU time grows with the wall clock while no frame comes). Through AF_XDP
/// with one worker (run by the I/O thread, its sockets busy-polled: the veth does not
/// defer its interrupts, and the log says how to have it do so), and through AF_PACKET
/// with two workers, each reading its own share.
#[test]
fn busy_polling_passes_every_frame_and_keeps_its_cores() {
    for (driver, tag, workers, thread) in [
        ("af_xdp", "bx", "1", "io"),
        ("af_packet", "bp", "2", "worker-1"),
    ] {
        let (lab, _dir, pipe_path) = Lab::with_pipeline_on(driver, tag, UDP_OUT);
        let dpuflow = lab.start_with(&[], &pipe_path, workers, &["--busy-poll"]);
        lab.udp_crosses_once();
        // A thread asleep between frames takes milliseconds a second; one polling, all it
        // gets (a share of a core here, where other tests run beside it), and it says that
        // it found nothing to do in that time.
        let seconds = |m: &str, what: &str| -> f64 {
            let series = format!("dpuflow_thread_{what}_seconds_total{{thread=\"{thread}\"}}");
            let line = m.lines().find_map(|l| l.strip_prefix(series.as_str()));
            let value = line.and_then(|v| v.trim().parse().ok());
            value.unwrap_or_else(|| panic!("{driver}: no {series}:\n{m}"))
        };
        let before = lab.metrics();
        std::thread::sleep(Duration::from_secs(1));
        let after = lab.metrics();
        let spent = seconds(&after, "cpu") - seconds(&before, "cpu");
        let idle = seconds(&after, "idle") - seconds(&before, "idle");
        assert!(
            spent > 0.25,
            "{driver}: {thread} took {spent} s of CPU in 1 s idle"
        );
        // Idle is counted in wall time, which a thread waiting for a core also spends.
        assert!(
            spent - idle < 0.1,
            "{driver}: {thread} busy {spent} s (idle {idle} s) with no traffic"
        );
        let log = stop(dpuflow);
        // Two workers on a machine of two CPUs leave none to the rest.
        let said = [
            "busy polling: the dataplane's threads poll without sleeping",
            "busy polling on every CPU",
        ];
        assert!(said.iter().any(|s| log.contains(s)), "{driver}: {log}");
        let hint = "busy polling: the interface does not defer its interrupts";
        assert_eq!(log.contains(hint), driver == "af_xdp", "{driver}: {log}");
    }
}

/// The interface's receive queues changed under a running service (`ethtool -L`): the
/// port is opened again with a socket on each, so the frames of the new queues reach the
/// pipeline rather than going around it to the dut's kernel.
#[test]
fn an_af_xdp_port_follows_its_interfaces_queues() {
    let (lab, _dir, pipe_path) = Lab::with_pipeline_queues("af_xdp", "k", 4, UDP_OUT);
    // A veth takes XDP only with as many receive queues as its peer has transmit queues:
    // refused, and said how to mend.
    lab.run(&lab.dut, &["ethtool", "-L", "in0", "rx", "1"]);
    let (refused, said) = lab.run_once(&pipe_path);
    assert!(
        !refused.success() && said.contains("too few queues for XDP"),
        "{said}"
    );
    lab.run(&lab.client, &["ethtool", "-L", "c0", "tx", "1"]);
    let dpuflow = lab.start(&pipe_path, "1");
    lab.run(&lab.dut, &["ethtool", "-L", "in0", "rx", "4"]);
    lab.run(&lab.client, &["ethtool", "-L", "c0", "tx", "4"]);
    // The port is looked at every tenth of a second while quiet.
    std::thread::sleep(Duration::from_millis(500));
    lab.send_udp_flows(5000, 2000, 64);
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    let m = lab.metrics_until(|m| metric(m, udp) == Some(2000), "read all 2000");
    let closed = "dpuflow_port_closed_total{port=\"inside\",reason=\"queues_changed\"}";
    assert!(metric(&m, closed).is_some_and(|n| n >= 1), "{m}");
    let log = stop(dpuflow);
    for said in [
        "mode=1 queue(s)",
        "the interface's receive queues changed",
        "live port open again iface=\"in0\" driver=\"AF_XDP\" mode=4 queue(s)",
    ] {
        assert!(log.contains(said), "{said:?} not in the log:\n{log}");
    }
}

/// Frames the kernel drops because a port's receive ring is full are counted
/// (`ring_full`): with the service stopped (SIGSTOP), 10,000 frames meet a ring of 4096
/// slots; once it runs again, what it read and what the ring dropped add up to them.
#[test]
fn a_full_receive_ring_is_counted() {
    full_ring("af_packet", "r", 3000..=4096);
}

/// The same for AF_XDP, whose RX ring holds 2048 frames.
#[test]
fn a_full_af_xdp_ring_is_counted() {
    full_ring("af_xdp", "q", 1500..=2048);
}

/// `read` is how many frames the ring holds, give or take the hosts' own chatter.
fn full_ring(driver: &str, tag: &str, read: std::ops::RangeInclusive<u64>) {
    let (lab, _dir, pipe_path) = Lab::with_pipeline_on(
        driver,
        tag,
        "pipe out root from inside {\n\
             rule udp { match ip.proto 17  actions drop }\n\
             default { actions drop }\n\
         }\n",
    );
    let dpuflow = lab.start(&pipe_path, "1");
    // `ip netns exec` becomes the service: its process is dpuflow's.
    let pid = dpuflow.0.id().to_string();
    tool_ok("kill", &["-STOP", &pid]);
    lab.send_udp(5000, 10_000);
    tool_ok("kill", &["-CONT", &pid]);
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    let full = "dpuflow_port_dropped_packets_total{port=\"inside\",reason=\"ring_full\"}";
    let m = lab.metrics_until(
        |m| metric(m, udp).unwrap_or(0) + metric(m, full).unwrap_or(0) >= 10_000,
        "accounted for every frame",
    );
    let (got, dropped) = (metric(&m, udp).unwrap_or(0), metric(&m, full).unwrap_or(0));
    assert!(read.contains(&got), "read {got}, ring full {dropped}");
    assert!(dropped >= 5000, "read {got}, ring full {dropped}");
    drop(dpuflow);
}

/// A flow that goes quiet on a live port is exported by the clock: with `idle_timeout 1s`,
/// nfcapd (in the service's namespace) holds the flow's record, three packets, while the
/// service still runs and no packet has come since.
#[test]
fn quiet_flows_are_exported_without_traffic() {
    let (lab, dir, pipe_path) = Lab::with_pipeline(
        "x",
        "telemetry { idle_timeout 1s }\n\
         pipe out root from inside {\n\
             rule udp { match ip.proto 17  actions fwd outside }\n\
             default { actions drop }\n\
         }\n",
    );
    let store = dir.0.join("nfcapd");
    std::fs::create_dir_all(&store).expect("mkdir");
    let store = store.display().to_string();
    let nfcapd = Running(lab.spawn(
        &lab.dut,
        &[
            "nfcapd",
            "-b",
            "127.0.0.1",
            "-p",
            "4739",
            "-w",
            &store,
            "-t",
            "3600",
        ],
    ));
    let bin = env!("CARGO_BIN_EXE_dpuflow");
    let args = [bin, "run", &pipe_path, "--metrics", "127.0.0.1:9464"];
    let _dpuflow = Running(lab.spawn(
        &lab.dut,
        &[&args[..], &["--ipfix", "127.0.0.1:4739"]].concat(),
    ));
    lab.metrics_until(|m| m.contains("dpuflow_build_info"), "dpuflow run serving");
    lab.send_udp(5000, 3);
    let udp = "dpuflow_rule_matched_packets_total{pipe=\"out\",rule=\"udp\"}";
    lab.metrics_until(|m| metric(m, udp) == Some(3), "counted the datagrams");
    // Idle for a second, found by the sweep within another: the cache empties (the hosts'
    // own link chatter, dropped, makes flows too); the exporter sends within a second.
    let entries = "dpuflow_flow_cache_entries";
    lab.metrics_until(
        |m| metric(m, entries) == Some(0),
        "exported the quiet flows",
    );
    std::thread::sleep(Duration::from_millis(1500));
    // nfcapd writes what it holds when stopped; the service goes on running.
    tool_ok("kill", &["-TERM", &nfcapd.0.id().to_string()]);
    std::thread::sleep(Duration::from_millis(500));
    let flows = tool_ok(
        "nfdump",
        &["-R", &store, "-q", "-o", "fmt:%sa,%da,%sp,%dp,%pkt"],
    );
    let flows: Vec<String> = flows
        .lines()
        .map(|l| l.split(',').map(str::trim).collect::<Vec<_>>().join(","))
        .filter(|l| l.starts_with(CLIENT))
        .collect();
    assert_eq!(flows, [format!("{CLIENT},{SERVER},4000,5000,3")], "nfdump");
}

/// The dataplane and the KV-cache service in one `dpuflow run`: the pipeline steers the
/// hosts' KV traffic `to kvcache` (not forwarded), and the service, listening on the
/// dut's own address on the inside link, answers redis-cli from the client through the
/// dut's network stack, as on a DPU through the Arm cores'.
#[test]
fn traffic_steered_to_the_kv_service_reaches_it_and_goes_no_further() {
    const KV: &str = "10.77.0.3";
    let dir = Scratch::new("live-kv");
    let target = dir.path("kv.img");
    let (lab, _pipes, pipe_path) = Lab::with_pipeline(
        "k",
        &format!(
            "service kvcache {{ listen {KV}:6379  target \"file://{target}\"  capacity 8MiB }}\n\
             pipe from_inside root from inside {{\n\
                 rule kv {{ match ipv4.dst {KV}  tcp.dst 6379  actions count, to kvcache }}\n\
                 default {{ actions fwd outside }}\n\
             }}\n\
             pipe from_outside root from outside {{ default {{ actions fwd inside }} }}\n"
        ),
    );
    lab.run(
        &lab.dut,
        &["ip", "addr", "add", &format!("{KV}/24"), "dev", "in0"],
    );
    let capture = dir.path("server.pcap");
    let tcpdump = lab.capture(&capture, "tcp port 6379");
    let _dpuflow = lab.start(&pipe_path, "1");
    let cli = |args: &[&str]| {
        let mut all = vec!["-h", KV, "-p", "6379"];
        all.extend_from_slice(args);
        in_netns(&lab.client, &[&["redis-cli"][..], &all].concat())
    };
    assert_eq!(cli(&["SET", "layer0", "from-the-host"]).trim(), "OK");
    assert_eq!(cli(&["GET", "layer0"]).trim(), "from-the-host");
    let steered = "dpuflow_service_queued_packets_total{service=\"kvcache\"}";
    let m = lab.metrics_until(
        |m| metric(m, steered).is_some_and(|n| n >= 6),
        "steered to the service",
    );
    assert!(
        metric(
            &m,
            "dpuflow_rule_matched_packets_total{pipe=\"from_inside\",rule=\"kv\"}"
        ) >= metric(&m, steered)
    );
    assert_eq!(
        metric(&m, "dpuflow_kvcache_keys{service=\"kvcache\"}"),
        Some(1)
    );
    tcpdump.stop();
    assert!(
        frames(&capture).is_empty(),
        "KV traffic was forwarded to the server"
    );
}

/// An address of the gateway's on the client's side.
const GATEWAY6: &str = "fd00:77::fe";

/// The VXLAN lab with no static neighbour, IPv6 addresses on the overlay, and a gateway
/// pipeline that answers for its tunnel endpoint on the underlay, and for the server's
/// overlay addresses and one of its own on the client's side: the lab, its scratch
/// directory, the pipeline's path and the client's MAC.
fn answering_gateway(tag: &str) -> (Lab, Scratch, String, String) {
    let (lab, dir, _) = vxlan_lab("af_packet", tag, 1, "");
    let client_mac = lab.mac(&lab.client, "c0");
    for (ns, args) in [
        (&lab.server, ["neigh", "flush", "dev", "s0"]),
        (&lab.server, ["neigh", "flush", "dev", "vxlan0"]),
        (&lab.client, ["neigh", "flush", "dev", "c0"]),
    ] {
        lab.run(
            ns,
            &[&["ip", "-s"][..], &args[..], &["nud", "all"]].concat(),
        );
    }
    for (ns, me, dev) in [
        (&lab.client, CLIENT6, "c0"),
        (&lab.server, SERVER6, "vxlan0"),
    ] {
        let me = format!("{me}/64");
        lab.run(ns, &["ip", "-6", "addr", "add", &me, "dev", dev, "nodad"]);
    }
    let underlay_mac = lab.mac(&lab.server, "s0");
    let encap = format!(
        "vxlan.encap {{ vni 100  src 192.0.2.1  dst 192.0.2.10 \
         smac 02:00:00:00:01:01  dmac {underlay_mac} }}"
    );
    let pipe_path = dir.path("answering.pipe");
    std::fs::write(
        &pipe_path,
        format!(
            "pipeline answering\n\
             port inside  {{ driver af_packet  iface \"in0\" }}\n\
             port outside {{ driver af_packet  iface \"out0\" }}\n\
             pipe encap root from inside {{\n\
                 rule to_server  {{ match ipv4.dst {SERVER}  actions {encap}, fwd outside }}\n\
                 rule to_server6 {{ match ipv6.dst {SERVER6}  actions {encap}, fwd outside }}\n\
                 default {{ actions goto resolve_overlay }}\n\
             }}\n\
             pipe resolve_overlay {{\n\
                 rule arp {{ match arp.op 1  arp.tpa {SERVER}  actions arp.reply {VXLAN_MAC}, fwd inside }}\n\
                 rule nd  {{ match icmp6.type 135  nd.target {SERVER6}\n\
                            actions nd.advert {VXLAN_MAC} router, fwd inside }}\n\
                 rule arp_replies {{ match arp.op 2  actions {encap}, fwd outside }}\n\
                 rule nd_gateway {{ match icmp6.type 135  nd.target {GATEWAY6}\n\
                                   actions nd.advert 02:00:00:00:01:01 router, fwd inside }}\n\
                 rule ping_gateway {{ match ipv6.dst {GATEWAY6}  icmp6.type 128  actions echo.reply, fwd inside }}\n\
                 default {{ actions drop }}\n\
             }}\n\
             pipe decap root from outside {{\n\
                 rule vni100 {{ match udp.dst 4789  vxlan.vni 100  actions vxlan.decap, fwd inside }}\n\
                 default {{ actions goto resolve_vtep }}\n\
             }}\n\
             pipe resolve_vtep {{\n\
                 rule arp {{ match arp.op 1  arp.tpa 192.0.2.1  actions arp.reply 02:00:00:00:01:01, fwd outside }}\n\
                 rule ping {{ match ipv4.dst 192.0.2.1  icmp.type 8  actions echo.reply, fwd outside }}\n\
                 default {{ actions drop }}\n\
             }}\n"
        ),
    )
    .expect("write pipeline");
    (lab, dir, pipe_path, client_mac)
}

/// Neighbours holding another hardware address for the addresses the gateway answers
/// for (an address moved here from another gateway): as its ports open, the gateway
/// announces them (an ARP Announcement, an unsolicited Neighbor Advertisement with the
/// Override flag), and the kernels on both sides take the gateway's address at once,
/// the IPv6 one as a router's, with no packet of theirs sent to the old one. Each is
/// announced twice, 2 seconds apart (RFC 5227 §2.3), as the server's link shows. A
/// reload that answers for the tunnel endpoint with another MAC announces that one twice,
/// and nothing else.
#[test]
fn neighbours_take_the_addresses_the_gateway_announces() {
    let (lab, dir, pipe_path, _) = answering_gateway("g");
    let neighbours = [
        (&lab.client, "-4", SERVER, "c0", VXLAN_MAC),
        (&lab.client, "-6", SERVER6, "c0", VXLAN_MAC),
        (&lab.client, "-6", GATEWAY6, "c0", "02:00:00:00:01:01"),
        (&lab.server, "-4", "192.0.2.1", "s0", "02:00:00:00:01:01"),
    ];
    for (ns, family, addr, dev, _) in neighbours {
        let moved_away = [
            "ip",
            family,
            "neigh",
            "replace",
            addr,
            "lladdr",
            "02:00:00:00:00:99",
            "dev",
            dev,
            "nud",
            "stale",
        ];
        lab.run(ns, &moved_away);
    }
    let pcap = dir.path("server-link.pcap");
    let capture = lab.capture(&pcap, "arp");
    let started = Instant::now();
    let dpuflow = lab.start(&pipe_path, "1");
    // What `ns`'s neighbour table holds for `addr` once it holds `mac` for it.
    let taken = |ns: &str, family: &str, addr: &str, dev: &str, mac: &str| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let seen = lab.run(ns, &["ip", family, "neigh", "show", addr, "dev", dev]);
            if seen.contains(&format!("lladdr {mac}")) {
                return seen;
            }
            assert!(Instant::now() < deadline, "not taken: {seen}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    for (ns, family, addr, dev, mac) in neighbours {
        let seen = taken(ns, family, addr, dev, mac);
        assert_eq!(seen.contains(" router "), family == "-6", "{seen}");
    }
    std::thread::sleep(
        (started + Duration::from_secs(4)).saturating_duration_since(Instant::now()),
    );
    capture.stop();
    // An ARP request from MAC whose sender and target are 192.0.2.1.
    let announced_from = |pcap: &str, mac: [u8; 6]| {
        let frames = frames(pcap);
        let announcement = |f: &&Vec<u8>| {
            f.len() >= 42
                && f[20..22] == [0, 1]
                && f[22..28] == mac
                && f[28..32] == [192, 0, 2, 1]
                && f[38..42] == [192, 0, 2, 1]
        };
        frames.iter().filter(announcement).count()
    };
    let announced = announced_from(&pcap, [2, 0, 0, 0, 1, 1]);
    assert_eq!(
        announced, 2,
        "announcements of 192.0.2.1 on the server's link"
    );

    // A reload that answers for the tunnel endpoint with another MAC announces that one,
    // twice, and nothing it answered for before.
    let (old_mac, new_mac) = ("02:00:00:00:01:01", "02:00:00:00:01:02");
    let (server, endpoint) = (&lab.server, "192.0.2.1");
    let held = [
        "ip", "neigh", "replace", endpoint, "lladdr", old_mac, "dev", "s0", "nud", "stale",
    ];
    lab.run(server, &held);
    let text = std::fs::read_to_string(&pipe_path).expect("read pipeline");
    let answer = "arp.reply 02:00:00:00:01:01, fwd outside";
    let moved = text.replace(answer, &format!("arp.reply {new_mac}, fwd outside"));
    assert_ne!(moved, text);
    std::fs::write(&pipe_path, moved).expect("write pipeline");
    let pcap = dir.path("server-link-reloaded.pcap");
    let capture = lab.capture(&pcap, "arp");
    let reloaded = Instant::now();
    tool_ok("kill", &["-HUP", &dpuflow.0.id().to_string()]);
    taken(server, "-4", endpoint, "s0", new_mac);
    std::thread::sleep(
        (reloaded + Duration::from_secs(4)).saturating_duration_since(Instant::now()),
    );
    capture.stop();
    assert_eq!(
        (
            announced_from(&pcap, [2, 0, 0, 0, 1, 1]),
            announced_from(&pcap, [2, 0, 0, 0, 1, 2])
        ),
        (0, 2),
        "announcements of 192.0.2.1 after the reload, from the old MAC and the new"
    );
    let log = stop(dpuflow);
    let anew: Vec<_> = log.lines().filter(|l| l.contains("anew")).collect();
    assert!(
        anew.len() == 1 && anew[0].contains("out0") && anew[0].contains("addresses=1"),
        "only the changed answer is announced:\n{log}"
    );
}

/// No static neighbour anywhere: the gateway answers the server's ARP requests for its
/// tunnel endpoint on the underlay, and the client's ARP requests and IPv6 neighbour
/// solicitations for the server's overlay addresses (with the Router flag), while the
/// server's own requests for the client's address cross the tunnel and the client's
/// replies cross back. The kernels on both sides take the answers (their neighbour
/// tables hold the gateway's addresses, learned, the IPv6 one as a router's) and the
/// hosts ping each other through the tunnel over IPv4 and IPv6. The server pings the
/// tunnel endpoint, and the client an address of the gateway's on its side over IPv6
/// (resolved, then answered): the kernels take the echo replies.
#[test]
fn hosts_resolve_the_gateway_and_the_overlay_from_its_answers() {
    let (lab, _dir, pipe_path, client_mac) = answering_gateway("r");
    let dpuflow = lab.start(&pipe_path, "1");
    assert!(lab.ping(&lab.client, SERVER), "no ping over IPv4");
    assert!(lab.ping(&lab.client, SERVER6), "no ping over IPv6");
    assert!(
        lab.ping(&lab.server, "192.0.2.1"),
        "the tunnel endpoint not answering"
    );
    assert!(lab.ping(&lab.client, GATEWAY6), "the gateway not answering");
    let neighbour = |ns: &str, family: &str, addr: &str, dev: &str| {
        lab.run(ns, &["ip", family, "neigh", "show", addr, "dev", dev])
    };
    for (seen, mac, router) in [
        (neighbour(&lab.client, "-4", SERVER, "c0"), VXLAN_MAC, false),
        (neighbour(&lab.client, "-6", SERVER6, "c0"), VXLAN_MAC, true),
        (
            neighbour(&lab.server, "-4", "192.0.2.1", "s0"),
            "02:00:00:00:01:01",
            false,
        ),
        (
            neighbour(&lab.server, "-4", CLIENT, "vxlan0"),
            &client_mac,
            false,
        ),
    ] {
        assert!(
            seen.contains(&format!("lladdr {mac}")) && !seen.contains("PERMANENT"),
            "{seen}"
        );
        assert_eq!(seen.contains(" router "), router, "{seen}");
    }
    let matched = |pipe: &str, rule: &str| {
        format!("dpuflow_rule_matched_packets_total{{pipe=\"{pipe}\",rule=\"{rule}\"}}")
    };
    let m = lab.metrics_until(
        |m| {
            [
                ("resolve_overlay", "arp"),
                ("resolve_overlay", "nd"),
                ("resolve_overlay", "arp_replies"),
                ("resolve_overlay", "ping_gateway"),
                ("resolve_vtep", "arp"),
                ("resolve_vtep", "ping"),
            ]
            .iter()
            .all(|(p, r)| metric(m, &matched(p, r)).unwrap_or(0) >= 1)
        },
        "answered each kind",
    );
    let unanswerable =
        "dpuflow_port_dropped_packets_total{port=\"inside\",reason=\"unanswerable\"}";
    assert_eq!(metric(&m, unanswerable), Some(0), "{m}");
    stop(dpuflow);
}
