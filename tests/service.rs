//! `dpuflow run` as operators run it: a live scrape checked by promtool and by our own
//! rules, a real Prometheus server scraping it, a golden exposition, graceful SIGTERM.

mod common;
use common::*;
use std::collections::HashSet;
use std::io::Write;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Service {
    child: Child,
    addr: SocketAddr,
}

impl Service {
    fn start(args: &[&str]) -> Service {
        Service::spawn(args, Stdio::null())
    }

    /// [`Service::start`] keeping the log, for [`Service::terminate_with_log`].
    fn start_logged(args: &[&str]) -> Service {
        Service::spawn(args, Stdio::piped())
    }

    /// `dpuflow run` on the VXLAN gateway with [`TRAFFIC`] as its host input (in `dir`),
    /// and `flags`.
    fn gateway(dir: &Scratch, flags: &[&str]) -> Service {
        scapy(&dir.0, TRAFFIC);
        let input = format!("host={}", dir.path("host.pcap"));
        let mut args = vec!["pipelines/vxlan-gateway.pipe", "--in", &input];
        args.extend_from_slice(flags);
        Service::start(&args)
    }

    /// `dpuflow run` on the stateful firewall example with `in.pcap` and `out.pcap` (in
    /// `dir`) as its inside and outside inputs, on `workers` workers.
    fn stateful_firewall(dir: &Scratch, workers: &str) -> Service {
        let inside = format!("inside={}", dir.path("in.pcap"));
        let outside = format!("outside={}", dir.path("out.pcap"));
        Service::start(&[
            "pipelines/stateful-firewall.pipe",
            "--in",
            &inside,
            "--in",
            &outside,
            "--workers",
            workers,
        ])
    }

    fn spawn(args: &[&str], stderr: Stdio) -> Service {
        Service::spawn_with_env(args, stderr, &[])
    }

    /// [`Service::spawn`] with `env` added to its environment.
    fn spawn_with_env(args: &[&str], stderr: Stdio, env: &[(&str, &str)]) -> Service {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
        let mut all = vec!["run"];
        all.extend_from_slice(args);
        let metrics = addr.to_string();
        all.extend_from_slice(&["--metrics", &metrics]);
        let child = dpuflow_command()
            .args(&all)
            .envs(env.iter().copied())
            .stderr(stderr)
            .spawn()
            .expect("spawn dpuflow run");
        let svc = Service { child, addr };
        let deadline = Instant::now() + Duration::from_secs(20);
        while get(addr, "/readyz").map(|(c, _)| c) != Some(200) {
            assert!(Instant::now() < deadline, "dpuflow run never became ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        svc
    }

    /// Scrapes until `pred` holds (the workers publish every 100 ms).
    fn scrape_until(&self, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let (code, body) =
                scrape(self.addr, "/metrics").unwrap_or_else(|e| panic!("scrape: {e}"));
            assert_eq!(code, 200);
            if pred(&body) {
                return body;
            }
            assert!(
                Instant::now() < deadline,
                "metrics never reached the expected state:\n{body}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn terminate(self) -> i32 {
        self.stop_by("TERM")
    }

    /// Sends `signal` (a name for kill(1): `TERM`, `HUP`…) and waits for the exit code.
    fn stop_by(mut self, signal: &str) -> i32 {
        self.signal_and_wait(signal)
    }

    /// Sends `signal` (a name for kill(1)).
    fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status();
    }

    fn signal_and_wait(&mut self, signal: &str) -> i32 {
        self.signal(signal);
        let what = format!("dpuflow run did not stop on SIG{signal}");
        exit_within(&mut self.child, Duration::from_secs(20), &what)
            .code()
            .unwrap_or(-1)
    }

    /// [`Service::terminate`] for a service started with [`Service::start_logged`]: the
    /// exit code and what it logged.
    fn terminate_with_log(mut self) -> (i32, String) {
        let mut log = String::new();
        let mut stderr = self.child.stderr.take().expect("started logged");
        let code = self.signal_and_wait("TERM");
        std::io::Read::read_to_string(&mut stderr, &mut log).expect("log");
        (code, log)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const TRAFFIC: &str = r#"
pkts = []
for i in range(100):
    p = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")/IP(src="10.0.0.%d" % (i % 50 + 1), dst="10.1.0.%d" % (i % 7 + 1))/UDP(sport=1000 + i, dport=5001)/Raw(b"x" * 20)
    p.time = 1000 + i * 0.001; pkts.append(p)
for i in range(10):
    p = Ether()/IP(src="10.0.0.1", dst="10.9.0.1")/UDP(sport=1, dport=5001); p.time = 1001 + i * 0.001; pkts.append(p)
wrpcap("host.pcap", pkts)
"#;

/// Series names and label sets; each must appear once.
#[test]
fn live_scrape_passes_promtool_and_our_rules() {
    let dir = Scratch::new("service-promtool");
    // IPFIX on (to a socket that reads nothing), so the flow-cache series are checked too.
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
    let ipfix = sink.local_addr().expect("addr").to_string();
    let svc = Service::gateway(&dir, &["--workers", "2", "--ipfix", &ipfix]);
    let body =
        svc.scrape_until(|b| b.contains("dpuflow_port_received_packets_total{port=\"host\"} 110"));
    assert!(body.contains("dpuflow_flow_records_total "), "{body}");
    assert_clean_exposition(&body);
    for needle in [
        "dpuflow_port_transmitted_packets_total{port=\"uplink\"} 100",
        "dpuflow_port_dropped_packets_total{port=\"host\",reason=\"rule\"} 10",
        "dpuflow_build_info{",
    ] {
        assert!(body.contains(needle), "missing {needle}");
    }
    assert_eq!(get(svc.addr, "/healthz").map(|(c, _)| c), Some(200));
    assert_eq!(get(svc.addr, "/nope").map(|(c, _)| c), Some(404));
    assert_eq!(svc.terminate(), 0);
}

/// A pipeline that tracks connections (the stateful firewall example, windows checked):
/// the conntrack series pass the same checks, and invalid packets are counted by reason.
#[test]
fn conntrack_series_pass_promtool_and_count_invalid_packets_by_reason() {
    let dir = Scratch::new("service-conntrack");
    scapy(
        &dir.0,
        r#"
C, S = "10.0.0.5", "203.0.113.10"
tcp = lambda src, dst, sp, dp, **kw: Ether()/IP(src=src, dst=dst)/TCP(sport=sp, dport=dp, **kw)
inside = [tcp(C, S, 40001, 443, flags="S", seq=100), tcp(C, S, 40001, 443, flags="A", seq=101, ack=901)]
outside = [tcp(S, C, 443, 40001, flags="SA", seq=900, ack=101),
           tcp(S, C, 443, 40001, flags="R", seq=50000),             # off-path: tcp_seq
           Ether()/IP(src=S, dst=C)/ICMP(type=0, id=99, seq=1)]      # unsolicited reply: icmp_reply
for i, p in enumerate(inside): p.time = 1000 + 2 * i * 0.01
for i, p in enumerate(outside): p.time = 1000.01 + 2 * i * 0.01
wrpcap("in.pcap", inside); wrpcap("out.pcap", outside)
"#,
    );
    let svc = Service::stateful_firewall(&dir, "1");
    let body =
        svc.scrape_until(|b| b.contains("dpuflow_port_received_packets_total{port=\"outside\"} 3"));
    assert_clean_exposition(&body);
    for needle in [
        "dpuflow_conntrack_entries 1",
        "dpuflow_conntrack_invalid_packets_total{reason=\"tcp_seq\"} 1",
        "dpuflow_conntrack_invalid_packets_total{reason=\"icmp_reply\"} 1",
        "dpuflow_conntrack_invalid_packets_total{reason=\"tcp_rst\"} 0",
        "dpuflow_conntrack_early_drops_total 0",
    ] {
        assert!(body.contains(needle), "missing {needle}:\n{body}");
    }
    assert_eq!(svc.terminate(), 0);
}

/// A collector that is not there: the exporter counts the messages the socket refuses
/// (loopback answers each with ICMP port unreachable, which fails the next send) and warns
/// once, not once a message.
#[test]
fn unreachable_collector_is_counted_and_warned_once() {
    let dir = Scratch::new("service-no-collector");
    scapy(&dir.0, TRAFFIC);
    let nobody = std::net::UdpSocket::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .to_string();
    let input = format!("host={}", dir.path("host.pcap"));
    let svc = Service::start_logged(&[
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &input,
        "--workers",
        "1",
        "--ipfix",
        &nobody,
    ]);
    let series = |name: &str| format!("{name}{{collector=\"{nobody}\"}}");
    let failed = series("dpuflow_ipfix_send_failures_total");
    let failures = |b: &str| metric(b, &failed).unwrap_or(0);
    let messages = series("dpuflow_ipfix_messages_total");
    let sent = |b: &str| metric(b, &messages).unwrap_or(0);
    // 57 flows make a templates message and several data messages: a scrape may come
    // between two of them (under an emulator, it did).
    let body = svc.scrape_until(|b| failures(b) > 0 && sent(b) + failures(b) >= 4);
    assert!(sent(&body) >= 1, "{body}");
    let (code, log) = svc.terminate_with_log();
    assert_eq!(code, 0);
    assert_eq!(log.matches("IPFIX messages not sent").count(), 1, "{log}");
}

/// A collector may be given by name: it is resolved at start and the export arrives there.
#[test]
fn collector_given_by_name_receives_the_export() {
    use std::net::{ToSocketAddrs, UdpSocket};
    let dir = Scratch::new("service-named-collector");
    // Listen where the name resolves first, where the service sends.
    let at = ("localhost", 0)
        .to_socket_addrs()
        .expect("localhost resolves")
        .next()
        .expect("an address");
    let collector = UdpSocket::bind(at).expect("bind");
    collector
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let named = format!("localhost:{}", collector.local_addr().expect("addr").port());
    let svc = Service::gateway(&dir, &["--workers", "1", "--ipfix", &named]);
    let mut message = [0u8; 2048];
    let n = uninterrupted(|| collector.recv(&mut message)).expect("an IPFIX message");
    // RFC 7011 §3.1: version 10, then the message's length.
    assert!(n >= 16, "{n} bytes");
    assert_eq!(message[..2], [0, 10]);
    assert_eq!(usize::from(u16::from_be_bytes([message[2], message[3]])), n);
    assert_eq!(svc.terminate(), 0);
}

/// IPFIX messages fit the path MTU given (`--ipfix-mtu`), with their IPv4 and UDP headers,
/// and by default a 1500-byte one.
#[test]
fn ipfix_messages_fit_the_path_mtu() {
    use std::net::UdpSocket;
    for (mtu, flag) in [(600, Some("600")), (1500, None)] {
        let dir = Scratch::new("service-ipfix-mtu");
        let collector = UdpSocket::bind("127.0.0.1:0").expect("bind");
        let at = collector.local_addr().expect("addr").to_string();
        let mut flags = vec!["--workers", "1", "--ipfix", &at];
        if let Some(f) = flag {
            flags.extend(["--ipfix-mtu", f]);
        }
        let svc = Service::gateway(&dir, &flags);
        // Wait for the first message, then stop: the rest (all flows, at shutdown) queue.
        collector
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        let mut buf = [0u8; 65536];
        let mut sizes = vec![uninterrupted(|| collector.recv(&mut buf)).expect("a message")];
        assert_eq!(svc.terminate(), 0);
        collector
            .set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        while let Ok(n) = uninterrupted(|| collector.recv(&mut buf)) {
            sizes.push(n);
        }
        let largest = sizes.iter().max().copied().unwrap_or(0);
        assert!(
            largest + 28 <= mtu,
            "MTU {mtu}: messages of {sizes:?} bytes"
        );
        // Full messages come close to the limit: 57 flows take more than one.
        assert!(
            largest + 28 + 64 > mtu,
            "MTU {mtu}: messages of {sizes:?} bytes"
        );
    }
}

/// With several workers, a tunnelled request and its untunnelled reply meet in one
/// worker's connection table (packets are dealt by the flow inside the tunnel): every
/// reply to a connection committed after `vxlan.decap` is let through. Dealt by the outer
/// headers, 13 of these 20 were dropped with two workers.
#[test]
fn decapsulated_connections_meet_their_replies_across_workers() {
    let dir = Scratch::new("service-ct-workers");
    scapy(
        &dir.0,
        r#"
up, host = [], []
for i in range(20):
    inner = Ether()/IP(src="10.1.0.5", dst="10.0.0.1")/UDP(sport=5000 + i, dport=3000)/Raw(b"req")
    p = Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000 + 7 * i, dport=4789)/VXLAN(vni=100, flags=0x08)/inner
    p.time = 1.0 + i * 0.001; up.append(p)
    r = Ether()/IP(src="10.0.0.1", dst="10.1.0.5")/UDP(sport=3000, dport=5000 + i)/Raw(b"resp")
    r.time = 2.0 + i * 0.001; host.append(r)
wrpcap("up.pcap", up); wrpcap("host.pcap", host)
"#,
    );
    let inputs = [
        ("uplink", dir.path("up.pcap")),
        ("host", dir.path("host.pcap")),
    ];
    all_out_with_two_and_three_workers(
        "tests/data/ct-after-decap.pipe",
        &inputs,
        ("uplink", &dir.path("replies.pcap")),
        20,
    );
}

/// Runs `pipe` over `inputs` (port, capture) with two and then three workers, and checks
/// that `n` packets went out of `out`'s port into its capture.
fn all_out_with_two_and_three_workers(
    pipe: &str,
    inputs: &[(&str, String)],
    (port, capture): (&str, &str),
    n: usize,
) {
    for workers in ["2", "3"] {
        let mut args = vec![pipe.to_owned()];
        for (p, file) in inputs {
            args.extend(["--in".to_owned(), format!("{p}={file}")]);
        }
        args.extend(["--out".to_owned(), format!("{port}={capture}")]);
        args.extend(["--workers".to_owned(), workers.to_owned()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let svc = Service::start(&args);
        // Short of `n`, the scrape's drops by reason say what became of the rest.
        let sent = format!("dpuflow_port_transmitted_packets_total{{port=\"{port}\"}} {n}");
        svc.scrape_until(|b| b.contains(&sent));
        assert_eq!(svc.terminate(), 0);
        assert_eq!(frames(capture).len(), n, "{workers} workers");
    }
}

/// With several workers, an ICMP error meets the connection of the packet it quotes (it is
/// dealt as that packet's flow): every port unreachable about a datagram the stateful
/// firewall let out, ICMP or ICMPv6, is related, and let in. Dealt by its own addresses, all twenty went
/// to one worker, and those about flows another worker held were dropped as invalid.
#[test]
fn icmp_errors_meet_their_connections_across_workers() {
    let dir = Scratch::new("service-icmp-workers");
    scapy(
        &dir.0,
        r#"
inside, outside = [], []
for i in range(20):
    if i < 12:
        q = Ether()/IP(src="10.0.0.5", dst="203.0.113.10")/UDP(sport=53000 + i, dport=53)/Raw(b"query")
        e = Ether()/IP(src="203.0.113.10", dst="10.0.0.5")/ICMP(type=3, code=3)/IP(bytes(q[IP])[:28])
    else:
        q = Ether()/IPv6(src="2001:db8::5", dst="2001:db8:1::10")/UDP(sport=53000 + i, dport=53)/Raw(b"query")
        e = Ether()/IPv6(src="2001:db8:1::10", dst="2001:db8::5")/ICMPv6DestUnreach(code=4)/IPv6(bytes(q[IPv6]))
    q.time = 1.0 + i * 0.001; inside.append(q)
    e.time = 2.0 + i * 0.001; outside.append(e)
wrpcap("in.pcap", inside); wrpcap("out.pcap", outside)
"#,
    );
    let inputs = [
        ("inside", dir.path("in.pcap")),
        ("outside", dir.path("out.pcap")),
    ];
    all_out_with_two_and_three_workers(
        "pipelines/stateful-firewall.pipe",
        &inputs,
        ("inside", &dir.path("errors.pcap")),
        20,
    );
}

/// Workers change where packets are processed, not what comes out: `run` with three
/// workers writes, port by port, the frames `replay` (one engine) writes, in some order.
#[test]
fn workers_write_what_replay_writes() {
    let dir = Scratch::new("service-vs-replay");
    let inputs = [
        "--in",
        "host=pipelines/captures/host.pcap",
        "--in",
        "uplink=pipelines/captures/uplink.pcap",
    ];
    let outputs = |tag: &str| {
        ["host", "uplink"].map(|p| format!("{p}={}", dir.path(&format!("{tag}-{p}.pcap"))))
    };
    let (replayed, served) = (outputs("replay"), outputs("run"));
    let mut args = vec!["replay", "pipelines/vxlan-gateway.pipe"];
    args.extend(inputs);
    for o in &replayed {
        args.extend(["--out", o]);
    }
    dpuflow_ok(&args);
    let mut args = vec!["pipelines/vxlan-gateway.pipe", "--workers", "3"];
    args.extend(inputs);
    for o in &served {
        args.extend(["--out", o]);
    }
    let svc = Service::start(&args);
    svc.scrape_until(|b| {
        b.contains("dpuflow_port_transmitted_packets_total{port=\"uplink\"} 180")
            && b.contains("dpuflow_port_transmitted_packets_total{port=\"host\"} 45")
    });
    assert_eq!(svc.terminate(), 0);
    for port in ["host", "uplink"] {
        let sorted = |tag: &str| {
            let mut f = frames(&dir.path(&format!("{tag}-{port}.pcap")));
            f.sort();
            f
        };
        let want = sorted("replay");
        assert!(!want.is_empty(), "{port}: nothing replayed");
        assert_eq!(sorted("run"), want, "{port}");
    }
}

/// A frame too large for the packet buffers (a capture taken with GRO on, say) is skipped
/// before any worker sees it: it still counts as received and as dropped (oversize), and
/// the log says so; it used to vanish from every metric.
#[test]
fn oversize_frames_are_counted_and_logged() {
    let dir = Scratch::new("service-oversize");
    scapy(
        &dir.0,
        r#"
f = lambda n: Ether()/IP(src="10.0.0.1", dst="10.1.0.1")/UDP(sport=1, dport=2)/Raw(b"x" * n)
wrpcap("host.pcap", [f(20), f(12000), f(30)])
"#,
    );
    let svc = Service::start_logged(&[
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("host.pcap")),
        "--workers",
        "1",
    ]);
    let body =
        svc.scrape_until(|b| b.contains("dpuflow_port_received_packets_total{port=\"host\"} 3"));
    assert!(
        body.contains("dpuflow_port_dropped_packets_total{port=\"host\",reason=\"oversize\"} 1"),
        "{body}"
    );
    let (code, log) = svc.terminate_with_log();
    assert_eq!(code, 0);
    assert!(
        log.contains("frame larger than the packet buffers"),
        "{log}"
    );
}

/// `--log-level`: `warn` leaves out the lines of a normal start and stop; `debug` adds
/// routine failures, here a client that connects to the metrics endpoint and leaves.
#[test]
fn the_log_level_chooses_the_lines_logged() {
    let dir = Scratch::new("service-log-level");
    scapy(&dir.0, TRAFFIC);
    let input = format!("host={}", dir.path("host.pcap"));
    let logged = |level: &str| {
        let svc = Service::start_logged(&[
            "pipelines/vxlan-gateway.pipe",
            "--in",
            &input,
            "--log-level",
            level,
        ]);
        drop(std::net::TcpStream::connect(svc.addr).expect("connect"));
        svc.scrape_until(|b| b.contains("dpuflow_port_received_packets_total{port=\"host\"}"));
        let (code, log) = svc.terminate_with_log();
        assert_eq!(code, 0, "{log}");
        log
    };
    let warn = logged("warn");
    assert!(warn.contains(" WARN "), "{warn}");
    assert!(!warn.contains(" INFO "), "{warn}");
    let debug = logged("debug");
    assert!(debug.contains(" INFO running"), "{debug}");
    assert!(debug.contains(" DEBUG http request failed"), "{debug}");
}

/// `--cpus`: the I/O thread on the list's first CPU, the workers on the others in turn,
/// and every other thread on the CPUs the list leaves (all of them, where it takes all).
#[test]
fn cpus_place_the_dataplane_threads() {
    use dpuflow::daemon::cpus;
    let allowed_of = |status: &str| {
        let list = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .expect("Cpus_allowed_list");
        cpus::parse(list).expect("a CPU list")
    };
    let ours = allowed_of(&std::fs::read_to_string("/proc/self/status").expect("status"));
    assert!(
        ours.starts_with(&[0, 1]),
        "the test needs CPUs 0 and 1, has {ours:?}"
    );
    let left: Vec<usize> = ours.iter().copied().filter(|&c| c > 1).collect();
    let others = if left.is_empty() { ours } else { left };
    let dir = Scratch::new("service-cpus");
    let svc = Service::gateway(&dir, &["--cpus", "0-1", "--workers", "3", "--loop"]);
    // The threads checked below live as long as the service.
    let placed: std::collections::BTreeMap<String, Vec<usize>> = thread_cpus(svc.child.id())
        .into_iter()
        .map(|(name, list)| (name, cpus::parse(&list).expect("a CPU list")))
        .collect();
    for (thread, cpus) in [
        ("io", vec![0]),
        ("worker-0", vec![1]),
        ("worker-1", vec![1]),
        ("worker-2", vec![1]),
        ("dpuflow", others.clone()),
        ("control", others),
    ] {
        assert_eq!(placed.get(thread), Some(&cpus), "{thread}: {placed:?}");
    }
    assert_eq!(svc.terminate(), 0);
}

/// An output that can no longer be written (a full disk: `/dev/full`) stops the service
/// with status 2 and says why; it used to go on serving metrics, ready, while no packet
/// moved.
#[test]
fn an_output_that_fails_stops_the_service() {
    let dir = Scratch::new("service-full");
    scapy(&dir.0, TRAFFIC);
    let run = dpuflow_command()
        .args(["run", "pipelines/vxlan-gateway.pipe", "--loop", "--in"])
        .arg(format!("host={}", dir.path("host.pcap")))
        .args(["--out", "uplink=/dev/full", "--metrics"])
        .arg(format!("127.0.0.1:{}", free_port()))
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn dpuflow run");
    // Killed if the test fails while it runs.
    let mut run = Running(run);
    let status = exit_within(
        &mut run.0,
        Duration::from_secs(30),
        "still running 30 s after its output failed",
    );
    let mut log = String::new();
    std::io::Read::read_to_string(&mut run.0.stderr.take().expect("log"), &mut log).expect("log");
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains("stopping the service") && log.contains("No space left on device"),
        "{log}"
    );
}

/// Workers share each meter's buckets: with three, a meter passes what it passes with one
/// (20,000 packets of 64 flows in 2 s through 1000 pps, burst 50: 2049 green), give or
/// take what the workers hold between them (a quarter of the burst and a packet each: at
/// most that much more, and when the run ends, about twice that left unused). Each worker
/// metering on its own passed up to three times as much.
#[test]
fn meters_hold_their_rate_across_workers() {
    let dir = Scratch::new("service-meters");
    let flows = dir.path("flows.pcap");
    bench_capture("tests/data/police.pipe", "a", 64, &flows);
    let frames = frames(&flows);
    assert_eq!(frames.len(), 64);
    let input = dir.path("traffic.pcap");
    let mut w =
        dpuflow::io::pcap::CaptureWriter::create(std::path::Path::new(&input)).expect("create");
    for k in 0..20_000u64 {
        let frame = &frames[k as usize % frames.len()];
        w.write(1_000_000_000 + k * 100_000, frame).expect("write");
    }
    w.finish().expect("finish");
    let green = |workers: &str| {
        let svc = Service::start(&[
            "tests/data/police.pipe",
            "--in",
            &format!("a={input}"),
            "--workers",
            workers,
        ]);
        let body = svc
            .scrape_until(|b| b.contains("dpuflow_port_received_packets_total{port=\"a\"} 20000"));
        assert_eq!(svc.terminate(), 0);
        metric(
            &body,
            "dpuflow_meter_packets_total{meter=\"limit\",color=\"green\"}",
        )
        .expect("green series")
    };
    assert_eq!(green("1"), 2049);
    let shared = green("3");
    assert!(
        (2049 - 2 * (50 / 4 + 3)..=2049 + 50 / 4 + 3).contains(&shared),
        "3 workers: {shared} green"
    );
}

/// A fragmented reply reaches the worker that holds its connection: the dealer sends a
/// datagram's first fragment by its flow, ports included (as the flow's whole packets go),
/// and its later fragments, which have no ports to hash, after it. 24 DNS queries from
/// inside, each answered in three fragments, through the stateful firewall with three
/// workers: every fragment gets in.
#[test]
fn fragmented_replies_meet_their_connections_across_workers() {
    let dir = Scratch::new("service-fragments");
    scapy(
        &dir.0,
        r#"
C, S = "10.0.0.5", "203.0.113.10"
EC = Ether(src="02:00:00:00:00:c1", dst="02:00:00:00:00:f1")
ES = Ether(src="02:00:00:00:00:51", dst="02:00:00:00:00:f2")
inside, outside = [], []
for i in range(24):
    q = EC/IP(src=C, dst=S)/UDP(sport=50000 + i, dport=53)/DNS(rd=1, qd=DNSQR(qname="example.org"))
    q.time = 10 + i
    inside.append(q)
    answer = ES/IP(src=S, dst=C, id=100 + i)/UDP(sport=53, dport=50000 + i)/Raw(b"a" * 3000)
    for k, f in enumerate(fragment(answer, fragsize=1200)):
        f.time = 10 + i + 0.5 + k * 0.01
        outside.append(f)
wrpcap("in.pcap", inside)
wrpcap("out.pcap", outside)
"#,
    );
    let svc = Service::stateful_firewall(&dir, "3");
    let body = svc.scrape_until(|b| {
        b.contains("dpuflow_port_received_packets_total{port=\"outside\"} 72")
            && b.contains("dpuflow_port_received_packets_total{port=\"inside\"} 24")
    });
    assert_eq!(svc.terminate(), 0);
    assert_eq!(
        metric(
            &body,
            "dpuflow_port_transmitted_packets_total{port=\"inside\"}"
        ),
        Some(72),
        "{body}"
    );
}

/// Clients that connect and send nothing hold up no one: a probe is answered at once while
/// they wait (the server gives a request 2 s; answering one connection at a time, four
/// silent ones held it for 8), and a HEAD gets the headers only.
#[test]
fn silent_clients_hold_up_no_probe() {
    let dir = Scratch::new("service-silent");
    let svc = Service::gateway(&dir, &["--workers", "1"]);
    let silent: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(svc.addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let asked = Instant::now();
    assert_eq!(get(svc.addr, "/healthz").map(|(c, _)| c), Some(200));
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "the probe waited {:?} behind silent clients",
        asked.elapsed()
    );
    let mut head = std::net::TcpStream::connect(svc.addr).expect("connect");
    head.write_all(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut head, &mut answer).expect("read");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("Content-Length: "), "{answer}");
    assert!(answer.ends_with("\r\n\r\n"), "a body after HEAD: {answer}");
    drop(silent);
    assert_eq!(svc.terminate(), 0);
}

/// Tables that cannot fit are refused at start, with their size, instead of the workers
/// being killed for memory as they write them: 16 workers × 2^28 connections is about 480
/// GiB, 16 flow caches of 2^26 flows about 112 GiB.
#[test]
fn tables_too_large_for_memory_are_refused() {
    let dir = Scratch::new("service-big-tables");
    let firewall = std::fs::read_to_string("pipelines/stateful-firewall.pipe")
        .expect("example")
        .replace("capacity 1000000", "capacity 268435456");
    std::fs::write(dir.0.join("big-ct.pipe"), firewall).expect("write");
    let gateway = std::fs::read_to_string("pipelines/vxlan-gateway.pipe").expect("example");
    let gateway = format!("{gateway}\ntelemetry {{ flow_cache 67108864 }}\n");
    std::fs::write(dir.0.join("big-flows.pipe"), gateway).expect("write");
    std::fs::write(dir.0.join("empty.pcap"), b"").expect("write");
    let refused = |pipe: &str, port: &str, ipfix: bool| {
        let mut cmd = dpuflow_command();
        cmd.args([
            "run",
            &dir.path(pipe),
            "--in",
            &format!("{port}={}", dir.path("empty.pcap")),
            "--workers",
            "16",
            "--metrics",
            &format!("127.0.0.1:{}", free_port()),
        ]);
        if ipfix {
            cmd.args(["--ipfix", "127.0.0.1:9"]);
        }
        let out = cmd.output().expect("dpuflow run");
        assert_eq!(out.status.code(), Some(2));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let log = refused("big-ct.pipe", "inside", false);
    assert!(
        log.contains("the workers' tables need")
            && log.contains("16 workers × a connection table of capacity 268435456)")
            && log.contains("lower `conntrack { capacity }` or --workers"),
        "{log}"
    );
    let log = refused("big-flows.pipe", "host", true);
    assert!(
        log.contains("16 workers × a flow cache of 67108864 flows)")
            && log.contains("lower `telemetry { flow_cache }` or --workers"),
        "{log}"
    );
}

/// A memory limit on the service's control group (a container's, a systemd unit's
/// `MemoryMax=`) counts as what is available: four flow caches of the default million
/// flows (464 MiB) are refused under a 200 MiB limit that the machine's own free memory
/// would hide, rather than killed by the group as the workers write them.
#[test]
fn a_control_groups_memory_limit_refuses_tables_beyond_it() {
    use dpuflow::sys::cgroup::{own_memory_groups, Version};
    let (own, version) = own_memory_groups()
        .into_iter()
        .next()
        .expect("this test needs a memory control group (cgroup v1 or v2) it can make groups in");
    /// The group, removed at the end however the test ends (once its process has gone).
    struct Group(std::path::PathBuf);
    impl Drop for Group {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let group = Group(own.join(format!("dpuflow-test-{}", std::process::id())));
    std::fs::create_dir(&group.0).unwrap_or_else(|e| panic!("make {}: {e}", group.0.display()));
    let limit = match version {
        Version::V1 => "memory.limit_in_bytes",
        Version::V2 => "memory.max",
    };
    std::fs::write(group.0.join(limit), "209715200").expect("set the group's limit");
    let dir = Scratch::new("service-cgroup-limit");
    std::fs::write(dir.0.join("empty.pcap"), b"").expect("write");
    // The shell moves itself into the group, then becomes dpuflow.
    let dpuflow = dpuflow_command();
    let out = Command::new("sh")
        .args([
            "-c",
            "echo $$ > \"$0\"/cgroup.procs && exec \"$@\"",
            &group.0.display().to_string(),
        ])
        .arg(dpuflow.get_program())
        .args(dpuflow.get_args())
        .args([
            "run",
            "pipelines/vxlan-gateway.pipe",
            "--in",
            &format!("host={}", dir.path("empty.pcap")),
            "--ipfix",
            "127.0.0.1:9",
            "--workers",
            "4",
            "--metrics",
            &format!("127.0.0.1:{}", free_port()),
        ])
        .output()
        .expect("sh");
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{log}");
    let available: u64 = log
        .split("MiB are available")
        .next()
        .and_then(|l| l.rsplit(' ').nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        log.contains("4 workers × a flow cache of 1048576 flows") && available <= 200,
        "{log}"
    );
}

/// Running out of file descriptors makes `accept` fail; the endpoint logs it and carries
/// on, answering again once connections close (it used to end the service).
#[test]
fn exhausted_descriptors_do_not_end_the_endpoint() {
    let dir = Scratch::new("service-emfile");
    let svc = Service::gateway(&dir, &["--workers", "1"]);
    let pid = svc.child.id();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .count();
    let limit = format!("--nofile={}", open + 1);
    let set = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &limit])
        .status()
        .expect("prlimit is required (Debian package util-linux)");
    assert!(set.success());
    // One connection takes the last descriptor; the rest wait, failing `accept`.
    let held: Vec<std::net::TcpStream> = (0..4)
        .map(|_| std::net::TcpStream::connect(svc.addr).expect("connect"))
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    drop(held);
    // The server drops the silent connection after its 2 s read timeout; then it answers.
    let deadline = Instant::now() + Duration::from_secs(15);
    while get(svc.addr, "/healthz").map(|(c, _)| c) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "the endpoint never answered again"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(svc.terminate(), 0);
}

#[test]
fn golden_exposition() {
    let dir = Scratch::new("service-golden");
    let svc = Service::gateway(&dir, &["--workers", "1"]);
    // The I/O thread counts what it could not send once it has written the last batch.
    let body = svc.scrape_until(|b| {
        b.contains("dpuflow_port_received_packets_total{port=\"host\"} 110")
            && b.contains("dpuflow_port_unsent_packets_total{port=\"uplink\"} 100")
    });
    assert_eq!(svc.terminate(), 0);
    // Times and versions vary from run to run; everything else is fixed by the input.
    let stable: String = body
        .lines()
        .filter(|l| {
            !l.starts_with("dpuflow_processing_latency_seconds_")
                && !l.starts_with("dpuflow_pipeline_load_duration_seconds{")
                && !l.starts_with("dpuflow_pipeline_last_load_timestamp_seconds{")
                // Listed while the threads run, which the end of the input ends.
                && !l.contains("dpuflow_thread_cpu_seconds_total")
                && !l.contains("dpuflow_thread_idle_seconds_total")
                && !l.starts_with("dpuflow_build_info{")
                // The process's own memory, CPU time, threads and descriptors.
                && !l.starts_with("process_")
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let golden = "tests/data/vxlan-gateway.metrics";
    if std::env::var_os("DPUFLOW_BLESS").is_some() {
        std::fs::write(golden, &stable).expect("write golden");
    }
    assert_eq!(
        stable,
        std::fs::read_to_string(golden).expect("golden file"),
        "exposition differs from {golden}"
    );
}

/// SIGTERM and SIGINT both stop it the same graceful way.
#[test]
fn stop_signals_during_traffic_exit_cleanly_with_outputs_flushed() {
    for signal in ["TERM", "INT"] {
        stop_during_traffic(signal);
    }
}

fn stop_during_traffic(signal: &str) {
    let dir = Scratch::new("service-stop");
    scapy(&dir.0, TRAFFIC);
    let out = dir.path("uplink.pcap");
    let svc = Service::start(&[
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("host.pcap")),
        "--out",
        &format!("uplink={out}"),
        "--loop",
        "--rate",
        "5000",
        "--workers",
        "2",
    ]);
    let body = svc.scrape_until(|b| {
        b.lines().any(|l| {
            l.starts_with("dpuflow_port_transmitted_packets_total{port=\"uplink\"} ")
                && !l.ends_with(" 0")
        })
    });
    assert!(body.contains("dpuflow_port_received_packets_total{port=\"host\"}"));
    assert_eq!(svc.stop_by(signal), 0, "SIG{signal}");
    // Every frame written is whole, and tshark reads the file to its end.
    let written = frames(&out);
    assert!(written.len() > 10, "SIG{signal}: {} frames", written.len());
    assert!(written.iter().all(|f| f.len() > 50));
    assert_tshark_clean(&out);
}

/// A graceful stop waits for the last flows' export, which keeps its pace; a second
/// signal ends the process at once, status 1.
#[test]
fn a_second_stop_signal_ends_a_slow_stop_at_once() {
    let dir = Scratch::new("service-second-signal");
    let capture = dir.path("host.pcap");
    bench_capture("pipelines/vxlan-gateway.pipe", "host", 20_000, &capture);
    // A collector that never reads: its buffer fills and the rest is dropped, unseen.
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").expect("sink");
    let collector = sink.local_addr().expect("address").to_string();
    let input = format!("host={capture}");
    let svc = Service::start(&[
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &input,
        "--ipfix",
        &collector,
        "--ipfix-rate",
        "100",
    ]);
    // Every flow's record is made at the end of the input; their thousand messages
    // take ten seconds at 100 a second.
    svc.scrape_until(|b| metric(b, "dpuflow_flow_records_total") == Some(20_000));
    let mut svc = svc;
    svc.signal("TERM");
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        svc.child.try_wait().expect("wait").is_none(),
        "the first signal should leave the export going"
    );
    let second = Instant::now();
    assert_eq!(svc.signal_and_wait("TERM"), 1);
    assert!(
        second.elapsed() < Duration::from_secs(2),
        "{:?}",
        second.elapsed()
    );
}

/// Copies `mirror` actions make are written to the mirror port's output, as `replay`
/// writes them, next to the packets forwarded.
#[test]
fn mirror_copies_reach_their_port() {
    let dir = Scratch::new("service-mirror");
    scapy(
        &dir.0,
        r#"wrpcap("in.pcap", [Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=i, dport=7005)/Raw(b"m" * 20) for i in range(1, 41)])"#,
    );
    let (copies, out) = (dir.path("copies.pcap"), dir.path("out.pcap"));
    let svc = Service::start(&[
        "tests/data/actions.pipe",
        "--in",
        &format!("in={}", dir.path("in.pcap")),
        "--out",
        &format!("out={out}"),
        "--out",
        &format!("copies={copies}"),
        "--workers",
        "2",
        "--batch",
        "8",
    ]);
    svc.scrape_until(|b| {
        b.lines()
            .any(|l| l == "dpuflow_port_transmitted_packets_total{port=\"copies\"} 40")
    });
    assert_eq!(svc.terminate(), 0);
    let mut written = frames(&copies);
    let mut sent = frames(&dir.path("in.pcap"));
    // Two workers: each keeps its flows' order, the file interleaves them.
    written.sort();
    sent.sort();
    assert_eq!(written, sent);
    assert_eq!(frames(&out).len(), 40);
    assert_tshark_clean(&copies);
}

/// With batches of one packet the service makes a few dozen buffers, then reads on into
/// those of the batches the workers have processed and written: every packet of a longer
/// input is still processed and written, once.
#[test]
fn long_input_through_few_buffers_is_written_whole() {
    let dir = Scratch::new("service-recycle");
    let (input, out) = (dir.path("host.pcap"), dir.path("uplink.pcap"));
    bench_capture("pipelines/vxlan-gateway.pipe", "host", 3000, &input);
    let svc = Service::start(&[
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={input}"),
        "--out",
        &format!("uplink={out}"),
        "--workers",
        "2",
        "--batch",
        "1",
    ]);
    svc.scrape_until(|b| {
        b.lines()
            .any(|l| l == "dpuflow_port_transmitted_packets_total{port=\"uplink\"} 3000")
    });
    assert_eq!(svc.terminate(), 0);
    let written: HashSet<Vec<u8>> = frames(&out).into_iter().collect();
    assert_eq!(frames(&out).len(), 3000);
    assert_eq!(written.len(), 3000, "every packet once");
}

#[test]
fn a_real_prometheus_scrapes_it() {
    let dir = Scratch::new("service-prometheus");
    let svc = Service::gateway(&dir, &["--workers", "2"]);
    let job = format!("static_configs:\n      - targets: ['{}']", svc.addr);
    prometheus_sees_the_gateway(&dir, &job);
    assert_eq!(svc.terminate(), 0);
}

/// Runs a Prometheus server whose one scrape job, `dpuflow`, is `job` (YAML under the job's
/// name, indented by four) until it reports the target `up` and the gateway's 110 host
/// packets, or fails after a minute.
fn prometheus_sees_the_gateway(dir: &Scratch, job: &str) {
    let prom_port = free_port();
    let config = dir.path("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: dpuflow\n    {job}\n"
        ),
    )
    .expect("config");
    let prom = Command::new("prometheus")
        .args([
            &format!("--config.file={config}"),
            &format!("--storage.tsdb.path={}", dir.path("tsdb")),
            &format!("--web.listen-address=127.0.0.1:{prom_port}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("prometheus is required (Debian package prometheus; scripts/test installs it)");
    let _prom = Running(prom);
    let api: SocketAddr = format!("127.0.0.1:{prom_port}").parse().expect("addr");
    let query = |q: &str| -> Option<String> {
        let (code, body) = get(api, &format!("/api/v1/query?query={q}"))?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (code == 200)
            .then(|| {
                v["data"]["result"][0]["value"][1]
                    .as_str()
                    .map(str::to_owned)
            })
            .flatten()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let up = query("up%7Bjob%3D%22dpuflow%22%7D");
        let rx = query("dpuflow_port_received_packets_total%7Bport%3D%22host%22%7D");
        if up.as_deref() == Some("1") && rx.as_deref() == Some("110") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not see the endpoint: up = {up:?}, \
             dpuflow_port_received_packets_total{{port=\"host\"}} = {rx:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `dpuflow run` of the VXLAN gateway with `telemetry` (a block) after it, its host port
/// reading `dir`'s host.pcap: the service, and its metrics endpoint's address (a free
/// port).
fn gateway_serving(dir: &Scratch, telemetry: &str) -> (Running, String) {
    let gateway = std::fs::read_to_string("pipelines/vxlan-gateway.pipe").expect("example");
    let pipe = dir.path("gateway.pipe");
    std::fs::write(&pipe, format!("{gateway}\n{telemetry}\n")).expect("pipeline");
    let addr = format!("127.0.0.1:{}", free_port());
    let input = format!("host={}", dir.path("host.pcap"));
    let svc = dpuflow_command()
        .args(["run", &pipe, "--in", &input, "--metrics", &addr])
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn dpuflow run");
    (Running(svc), addr)
}

/// With `tls_cert` and `tls_key` in its telemetry block the metrics endpoint speaks only
/// HTTPS: curl trusting the test CA reads `/metrics` and `/healthz`, one that does not
/// trust it, or plain HTTP, gets nothing. With `tls_client_ca` too, only a client
/// presenting a certificate that CA signed is answered: a real Prometheus scraping with
/// `scheme: https` and its client certificate sees the target up and the packets. On
/// SIGHUP the certificate and key files are read again: rotated, they serve at once;
/// spoilt, the ones before stay.
#[test]
fn the_metrics_endpoint_over_tls_answers_only_clients_it_trusts() {
    let dir = Scratch::new("service-tls");
    certificates(&dir);
    scapy(&dir.0, TRAFFIC);
    let (ca, cert, key) = (
        dir.path("ca.pem"),
        dir.path("client.pem"),
        dir.path("client.key"),
    );
    for client_ca in [false, true] {
        let mut telemetry = format!(
            "telemetry {{ tls_cert \"{}\"  tls_key \"{}\"",
            dir.path("server.pem"),
            dir.path("server.key")
        );
        if client_ca {
            telemetry += &format!("  tls_client_ca \"{ca}\"");
        }
        let (svc, addr) = gateway_serving(&dir, &format!("{telemetry} }}"));
        let url = |path: &str| format!("https://{addr}{path}");
        let trusted = |path: &str, extra: &[&str]| {
            let mut args = vec!["-s", "--max-time", "5", "--cacert", &ca];
            args.extend_from_slice(extra);
            let url = url(path);
            args.push(&url);
            tool("curl", &args)
        };
        let client = ["--cert", &cert, "--key", &key];
        let with_cert: &[&str] = if client_ca { &client } else { &[] };
        let deadline = Instant::now() + Duration::from_secs(20);
        while trusted("/readyz", with_cert).stdout != b"ready\n" {
            assert!(Instant::now() < deadline, "never ready over TLS");
            std::thread::sleep(Duration::from_millis(100));
        }
        let metrics = String::from_utf8(trusted("/metrics", with_cert).stdout).expect("text");
        assert_eq!(
            metric(
                &metrics,
                "dpuflow_port_received_packets_total{port=\"host\"}"
            ),
            Some(110),
            "{metrics}"
        );
        assert_eq!(trusted("/healthz", with_cert).stdout, b"ok\n");
        // Not trusting the server's certificate, or not speaking TLS: nothing.
        let untrusting = tool("curl", &["-s", "--max-time", "5", &url("/metrics")]);
        assert!(!untrusting.status.success() && untrusting.stdout.is_empty());
        let plain = get(addr.parse().expect("addr"), "/metrics");
        assert!(plain.is_none(), "plain HTTP answered: {plain:?}");
        if client_ca {
            let anonymous = trusted("/metrics", &[]);
            assert!(!anonymous.status.success() && anonymous.stdout.is_empty());
        }
        // Each of those refusals is counted (once its connection's thread has ended).
        let refused = if client_ca { 3 } else { 2 };
        let deadline = Instant::now() + Duration::from_secs(5);
        let failures = loop {
            let metrics = String::from_utf8(trusted("/metrics", with_cert).stdout).expect("text");
            let failures = metric(&metrics, "dpuflow_metrics_endpoint_tls_failures_total");
            if failures >= Some(refused) || Instant::now() > deadline {
                break failures;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(failures, Some(refused));
        if client_ca {
            let job = format!(
                "scheme: https\n    tls_config:\n      ca_file: {ca}\n      cert_file: {cert}\n      \
                 key_file: {key}\n    static_configs:\n      - targets: ['{addr}']"
            );
            prometheus_sees_the_gateway(&dir, &job);

            // Certificates rotated in place (the server's now from another CA): SIGHUP and
            // the endpoint presents the new one, trusted by the new CA only.
            let rotated = Scratch::new("service-tls-rotated");
            certificates(&rotated);
            for f in ["server.pem", "server.key"] {
                std::fs::copy(rotated.path(f), dir.path(f)).expect("rotate");
            }
            tool_ok("kill", &["-HUP", &svc.0.id().to_string()]);
            let new_ca = rotated.path("ca.pem");
            let with_new_ca = |path: &str| {
                let url = url(path);
                let args = [
                    "-s",
                    "--max-time",
                    "5",
                    "--cacert",
                    &new_ca,
                    "--cert",
                    &cert,
                ];
                tool("curl", &[&args[..], &["--key", &key, &url]].concat())
            };
            let deadline = Instant::now() + Duration::from_secs(10);
            while with_new_ca("/healthz").stdout != b"ok\n" {
                assert!(
                    Instant::now() < deadline,
                    "the rotated certificate never served"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            let old = trusted("/healthz", with_cert);
            assert!(!old.status.success() && old.stdout.is_empty());
            // A key that is not a key: the certificate before goes on serving.
            std::fs::write(dir.path("server.key"), "not a key\n").expect("spoil");
            tool_ok("kill", &["-HUP", &svc.0.id().to_string()]);
            std::thread::sleep(Duration::from_millis(500));
            assert_eq!(with_new_ca("/healthz").stdout, b"ok\n");
        }
    }
}

/// With `basic_auth_file` (an htpasswd file made by `htpasswd -B`) the endpoint answers
/// `/metrics` over its TLS only to the file's users: curl without a password, or with a
/// wrong one, gets 401, each counted; with the user's, the packets; the probes' paths need
/// none. A real Prometheus scraping with `basic_auth` and a `password_file` sees the
/// target up. On SIGHUP the file is read again: a user it now names is admitted, the one
/// it no longer names is not.
#[test]
fn the_metrics_endpoint_admits_only_its_users() {
    let dir = Scratch::new("service-users");
    certificates(&dir);
    scapy(&dir.0, TRAFFIC);
    let users = dir.path("users");
    tool_ok(
        "htpasswd",
        &["-B", "-b", "-c", &users, "prometheus", "s3cret"],
    );
    let telemetry = format!(
        "telemetry {{ tls_cert \"{}\"  tls_key \"{}\"  basic_auth_file \"{users}\" }}",
        dir.path("server.pem"),
        dir.path("server.key")
    );
    let (svc, addr) = gateway_serving(&dir, &telemetry);
    let ca = dir.path("ca.pem");
    // The status and the body of a GET, as `user:password` where given.
    let curl = |path: &str, user: Option<&str>| -> (String, String) {
        let url = format!("https://{addr}{path}");
        let mut args = vec![
            "-s",
            "--max-time",
            "5",
            "--cacert",
            &ca,
            "-w",
            "\n%{http_code}",
        ];
        if let Some(user) = user {
            args.extend(["-u", user]);
        }
        args.push(&url);
        let out = String::from_utf8(tool("curl", &args).stdout).expect("text");
        let (body, code) = out.rsplit_once('\n').unwrap_or_default();
        (code.to_owned(), body.to_owned())
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while curl("/readyz", None).1 != "ready\n" {
        assert!(Instant::now() < deadline, "never ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(curl("/healthz", None), ("200".into(), "ok\n".into()));
    assert_eq!(curl("/metrics", None).0, "401");
    assert_eq!(curl("/metrics", Some("prometheus:secret")).0, "401");
    assert_eq!(curl("/metrics", Some("nobody:s3cret")).0, "401");
    let (code, metrics) = curl("/metrics", Some("prometheus:s3cret"));
    assert_eq!(code, "200");
    let received = "dpuflow_port_received_packets_total{port=\"host\"}";
    assert_eq!(metric(&metrics, received), Some(110), "{metrics}");
    let failures = metric(&metrics, "dpuflow_metrics_endpoint_auth_failures_total");
    assert_eq!(failures, Some(3), "{metrics}");

    let password = dir.path("password");
    std::fs::write(&password, "s3cret\n").expect("password file");
    let job = format!(
        "scheme: https\n    tls_config:\n      ca_file: {ca}\n    basic_auth:\n      \
         username: prometheus\n      password_file: {password}\n    static_configs:\n      \
         - targets: ['{addr}']"
    );
    prometheus_sees_the_gateway(&dir, &job);

    // The file made anew with another user: read on SIGHUP.
    tool_ok("htpasswd", &["-B", "-b", "-c", &users, "scraper", "n3w"]);
    tool_ok("kill", &["-HUP", &svc.0.id().to_string()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while curl("/metrics", Some("scraper:n3w")).0 != "200" {
        assert!(Instant::now() < deadline, "the new user was never admitted");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(curl("/metrics", Some("prometheus:s3cret")).0, "401");
}

/// SIGHUP reloads the pipeline file while packets flow: the new rules decide from then
/// on, counters of rules kept go on from where they were (a rule new to the file starts at
/// zero), and the port counters never restart. A file with errors, or one changing what
/// only a restart applies (a port), is refused with the reason logged, and the running
/// pipeline carries on.
#[test]
fn sighup_reloads_the_pipeline_while_packets_flow() {
    let dir = Scratch::new("service-reload");
    scapy(
        &dir.0,
        r#"wrpcap("in.pcap", [Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1000 + i, dport=(53, 80)[i % 2]) for i in range(100)])"#,
    );
    let pipe = dir.path("reload.pipe");
    let write = |rules: &str, port_b: &str| {
        let text = format!(
            "pipeline reload\nport a {{ driver pcap }}\nport b {{ {port_b} }}\n\
             pipe f root from a {{\n{rules}\n    default {{ actions drop }}\n}}\n"
        );
        std::fs::write(&pipe, text).expect("write pipeline");
    };
    let both = "    rule dns { match udp.dst 53  actions fwd b }\n    \
                rule web { match udp.dst 80  actions fwd b }";
    write(both, "driver pcap");
    let input = format!("a={}", dir.path("in.pcap"));
    let svc = Service::start_logged(&[
        &pipe,
        "--in",
        &input,
        "--loop",
        "--rate",
        "4000",
        "--workers",
        "2",
    ]);
    let series = |b: &str, name: &str| metric(b, name).unwrap_or_else(|| panic!("{name}:\n{b}"));
    let dns = "dpuflow_rule_matched_packets_total{pipe=\"f\",rule=\"dns\"}";
    let web = "dpuflow_rule_matched_packets_total{pipe=\"f\",rule=\"web\"}";
    let ntp = "dpuflow_rule_matched_packets_total{pipe=\"f\",rule=\"ntp\"}";
    let received = "dpuflow_port_received_packets_total{port=\"a\"}";
    let dropped = "dpuflow_port_dropped_packets_total{port=\"a\",reason=\"rule\"}";
    let reloads = |result: &str| format!("dpuflow_pipeline_reloads_total{{result=\"{result}\"}}");
    let before = svc.scrape_until(|b| metric(b, web).unwrap_or(0) > 200);
    assert_eq!(series(&before, &reloads("success")), 0);
    assert_eq!(
        series(&before, "dpuflow_pipeline_last_reload_successful"),
        1
    );
    assert_eq!(series(&before, dropped), 0);
    // The dataplane's threads and their CPU time, no more than they have been running.
    for thread in ["io", "worker-0", "worker-1"] {
        let series = format!("dpuflow_thread_cpu_seconds_total{{thread=\"{thread}\"}} ");
        let cpu: f64 = before
            .lines()
            .find_map(|l| l.strip_prefix(&series)?.parse().ok())
            .unwrap_or_else(|| panic!("no {series}in:\n{before}"));
        assert!((0.0..20.0).contains(&cpu), "{series}{cpu}");
    }

    // Web traffic is dropped from now on; a rule is added in front.
    write(
        "    rule ntp { match udp.dst 123  actions fwd b }\n    \
         rule dns { match udp.dst 53  actions fwd b }\n    \
         rule web { match udp.dst 80  actions drop }",
        "driver pcap",
    );
    svc.signal("HUP");
    let after = svc.scrape_until(|b| {
        metric(b, &reloads("success")) == Some(1) && metric(b, dropped).unwrap_or(0) > 100
    });
    for name in [dns, web, received] {
        assert!(
            series(&after, name) > series(&before, name),
            "{name} went on from where it was:\n{before}\n{after}"
        );
    }
    assert_eq!(series(&after, ntp), 0);
    // Every web packet since the reload was dropped: the drops are what the web rule
    // counted past its count at the reload, give or take the packets between scrapes.
    let at_reload = series(&after, web) - series(&after, dropped);
    assert!(at_reload >= series(&before, web), "{after}");
    assert_clean_exposition(&after);

    // Errors: refused, and the pipeline runs on.
    std::fs::write(
        &pipe,
        "pipeline reload\nport a { driver pcap }\npipe f root from a {\n",
    )
    .expect("write pipeline");
    svc.signal("HUP");
    let refused = svc.scrape_until(|b| metric(b, &reloads("failure")) == Some(1));
    assert_eq!(
        series(&refused, "dpuflow_pipeline_last_reload_successful"),
        0
    );
    let later = svc.scrape_until(|b| series(b, received) > series(&refused, received));
    assert!(series(&later, dropped) > series(&refused, dropped));

    // A port changed: refused.
    write(both, "driver af_packet iface \"lo\"");
    svc.signal("HUP");
    svc.scrape_until(|b| metric(b, &reloads("failure")) == Some(2));

    let (code, log) = svc.terminate_with_log();
    assert_eq!(code, 0, "{log}");
    assert!(log.contains("pipeline reloaded"), "{log}");
    assert!(log.contains("the pipeline has errors"), "{log}");
    assert!(
        log.contains("port `b` changed: restart the service to apply"),
        "{log}"
    );
}

/// Under a service manager (systemd's `Type=notify`): told `READY=1` and a status once the
/// workers run, `WATCHDOG=1` as often as asked, `RELOADING=1` then `READY=1` around a
/// reload, `STOPPING=1` at the stop. An output that takes nothing (a FIFO nobody reads)
/// stalls the I/O thread: `/healthz` fails and says which thread, the status says so, and
/// the watchdog goes unfed, so that the manager restarts the service; once the output
/// takes again, all is as before.
#[test]
fn a_service_manager_is_told_how_it_stands_and_a_stalled_dataplane_fails_its_health() {
    let dir = Scratch::new("service-notify");
    let socket = dir.path("notify");
    let manager = Manager::bind(&socket);
    let input = dir.path("host.pcap");
    bench_capture("pipelines/vxlan-gateway.pipe", "host", 100, &input);
    let fifo = dir.path("uplink.fifo");
    tool_ok("mkfifo", &[&fifo]);
    // The output's reader: opened as the service opens it, read from only when told.
    let (drain_tx, drain_rx) = std::sync::mpsc::channel::<()>();
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || {
            let mut f = std::fs::File::open(&fifo).expect("open the FIFO");
            let _ = drain_rx.recv();
            std::io::copy(&mut f, &mut std::io::sink()).expect("drain")
        })
    };
    let (host, uplink) = (format!("host={input}"), format!("uplink={fifo}"));
    let svc = Service::spawn_with_env(
        &[
            "pipelines/vxlan-gateway.pipe",
            "--in",
            &host,
            "--out",
            &uplink,
            "--loop",
            "--rate",
            "20000",
        ],
        Stdio::null(),
        &[("NOTIFY_SOCKET", &socket), ("WATCHDOG_USEC", "400000")],
    );
    let first = manager.next();
    assert!(
        first.starts_with("READY=1\nSTATUS=running pipeline vxlan_gateway (generation 0)"),
        "{first}"
    );
    manager.until(|d| d == "WATCHDOG=1");

    svc.signal("HUP");
    let reload = manager.until(|d| d.starts_with("READY=1"));
    assert!(reload.contains(&"RELOADING=1".to_owned()), "{reload:?}");
    assert!(
        reload.last().is_some_and(|d| d.contains("(generation 1)")),
        "{reload:?}"
    );

    // The FIFO's buffer fills; five seconds after, the I/O thread counts as stalled.
    let stalled = manager.until(|d| d.contains("STATUS=dataplane stalled: io"));
    assert!(
        !stalled.last().is_some_and(|d| d.contains("WATCHDOG")),
        "{stalled:?}"
    );
    let (code, body) = get(svc.addr, "/healthz").expect("healthz");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.starts_with("dataplane stalled: io (no progress for "),
        "{body}"
    );
    // A worker has nothing to do, which is not a stall.
    assert!(!body.contains("worker"), "{body}");
    let stalled = |b: &str| metric(b, "dpuflow_dataplane_stalled_threads");
    svc.scrape_until(|b| stalled(b) == Some(1));
    // Unfed for as long as it stays stalled.
    std::thread::sleep(Duration::from_secs(1));
    drain_tx.send(()).expect("drain");
    let recovered = manager.until(|d| d.contains("STATUS=running pipeline"));
    assert!(
        recovered[..recovered.len() - 1]
            .iter()
            .all(|d| !d.contains("WATCHDOG")),
        "fed while stalled: {recovered:?}"
    );
    manager.until(|d| d.contains("WATCHDOG=1"));
    assert_eq!(get(svc.addr, "/healthz"), Some((200, "ok\n".to_owned())));
    svc.scrape_until(|b| stalled(b) == Some(0));

    assert_eq!(svc.terminate(), 0);
    let last = manager.until(|d| d.starts_with("STOPPING=1"));
    assert!(
        last.last().is_some_and(|d| d.contains("STATUS=stopping")),
        "{last:?}"
    );
    assert!(reader.join().expect("reader") > 0);
}
