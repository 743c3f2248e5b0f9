//! IPFIX export read by real collectors: nfcapd stores what `dpuflow run --ipfix` sends and
//! `nfdump` must list exactly the flows of the input with their packet and byte counts;
//! tshark decodes the same messages with no expert errors and no sequence-number gaps.
//! Once from the flow cache (a pipeline without connection tracking), once mostly from
//! connection entries (the stateful firewall).

mod common;
use common::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn free_tcp_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn stop(mut c: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &c.id().to_string()])
        .status();
    exit_within(&mut c, Duration::from_secs(20), "process did not stop");
}

/// Writes `flows.txt`, each flow of `pkts` as "src dst sport dport proto packets bytes"; a
/// datagram's later fragments are of the flow whose ports its first fragment carried. An
/// ICMP flow has no ports: it is told by its type and code (type × 256 + code, where the
/// destination port goes).
const COUNT_FLOWS: &str = r#"
import struct
flows, firsts = {}, {}
for p in pkts:
    ip = p[IP] if IP in p else p[IPv6]
    v4 = IP in p
    proto, ident = (ip.proto, ip.id) if v4 else (ip.nh, 0)
    if not v4 or ip.frag == 0:
        head = bytes(ip.payload)[:4]
        ports = (0, head[0] * 256 + head[1]) if proto in (1, 58) else struct.unpack("!HH", head)
        firsts[(ip.src, ip.dst, ident)] = ports
    k = (ip.src, ip.dst) + firsts[(ip.src, ip.dst, ident)] + (proto,)
    c = flows.get(k, (0, 0)); flows[k] = (c[0] + 1, c[1] + len(bytes(ip)))
open("flows.txt", "w").write("\n".join("%s %s %d %d %d %d %d" % (k + v) for k, v in flows.items()))
"#;

/// Into the VXLAN gateway from the host.
const TRAFFIC: &str = r#"
pkts, t = [], 1000.0
def add(p):
    global t
    p.time = t; t += 0.001; pkts.append(p)
for i in range(20):
    for n in range(i % 4 + 1):
        add(Ether()/IP(src="10.0.0.%d" % (i + 1), dst="10.1.0.%d" % (i % 5 + 1))/UDP(sport=2000 + i, dport=5001)/Raw(b"x" * (10 + i)))
for n in range(3):
    add(Ether()/IP(src="10.0.0.99", dst="10.1.9.9")/TCP(sport=33000, dport=443, flags="S" if n == 0 else "A"))
for n in range(2):
    add(Ether()/IP(src="10.0.0.50", dst="10.7.0.1")/UDP(sport=9, dport=9)/Raw(b"dropped"))   # outside 10.1/16: dropped
wrpcap("host.pcap", pkts)
"#;

/// [`TRAFFIC`] and datagrams too big for one packet between whole packets of their flow
/// (a fragment's record is its flow's), written to `host.pcap` again.
const FRAGMENTED_TRAFFIC: &str = r#"
for n in range(3):
    add(Ether()/IP(src="10.0.0.77", dst="10.1.0.7")/UDP(sport=7000, dport=5001)/Raw(b"w"))
    for f in fragment(Ether()/IP(src="10.0.0.77", dst="10.1.0.7", id=4200 + n)/UDP(sport=7000, dport=5001)/Raw(b"f" * 3000), fragsize=1400):
        add(f)
wrpcap("host.pcap", pkts)
"#;

/// Through the stateful firewall, both ways: a TCP connection that resets and is opened
/// again on the same ports 200 s later (the lookup then finds the closed one expired and
/// ends it: flowEndReason 3), a DNS exchange with one answer in fragments, and packets the
/// firewall drops from outside and to a port it does not allow.
const FIREWALL_TRAFFIC: &str = r#"
inside, outside, pkts, t = [], [], [], 1000.0
def add(side, p, gap=0.001):
    global t
    t += gap; p.time = t; side.append(p); pkts.append(p)
c, s = "10.0.0.1", "198.51.100.1"
def tcp(side, src, dst, sp, dp, flags, payload=b""):
    add(side, Ether()/IP(src=src, dst=dst)/TCP(sport=sp, dport=dp, flags=flags)/Raw(payload))
for gap in (0.001, 200.0):
    add(inside, Ether()/IP(src=c, dst=s)/TCP(sport=40000, dport=443, flags="S"), gap)
    tcp(outside, s, c, 443, 40000, "SA")
    tcp(inside, c, s, 40000, 443, "A")
    tcp(inside, c, s, 40000, 443, "PA", b"q" * 100)
    tcp(outside, s, c, 443, 40000, "PA", b"r" * 300)
    tcp(inside, c, s, 40000, 443, "R")
for n in range(3):
    add(inside, Ether()/IP(src="10.0.0.2", dst="198.51.100.53")/UDP(sport=5353, dport=53)/Raw(b"query%d" % n))
    if n < 2:
        add(outside, Ether()/IP(src="198.51.100.53", dst="10.0.0.2")/UDP(sport=53, dport=5353)/Raw(b"answer" * 5))
# An answer too big for one packet: its fragments count in the connection's record.
for f in fragment(Ether()/IP(src="198.51.100.53", dst="10.0.0.2", id=900)/UDP(sport=53, dport=5353)/Raw(b"a" * 3000), fragsize=1400):
    add(outside, f)
for n in range(2):
    tcp(outside, "203.0.113.9", c, 1234, 22, "S")
    add(inside, Ether()/IP(src="10.0.0.3", dst="198.51.100.1")/UDP(sport=999, dport=25)/Raw(b"no"))
# Pings and their echoes, a port unreachable about the DNS query (related: it passes),
# and a reply whose code differs from its request's (it answers nothing: dropped). Each
# type and code is a flow of its own.
for n in range(3):
    add(inside, Ether()/IP(src=c, dst=s)/ICMP(type=8, id=7, seq=n)/Raw(b"ping"))
    add(outside, Ether()/IP(src=s, dst=c)/ICMP(type=0, id=7, seq=n)/Raw(b"ping"))
add(outside, Ether()/IP(src="198.51.100.53", dst="10.0.0.2")/ICMP(type=3, code=3)/IP(src="10.0.0.2", dst="198.51.100.53")/UDP(sport=5353, dport=53, len=14, chksum=0)/Raw(b"query0"))
for n in range(2):
    add(inside, Ether()/IPv6(src="2001:db8::5", dst="2001:db8:1::10")/ICMPv6EchoRequest(id=9, seq=n))
    add(outside, Ether()/IPv6(src="2001:db8:1::10", dst="2001:db8::5")/ICMPv6EchoReply(id=9, seq=n))
add(inside, Ether()/IP(src=c, dst="198.51.100.7")/ICMP(type=8, code=40, id=8)/Raw(b"odd"))
add(outside, Ether()/IP(src="198.51.100.7", dst=c)/ICMP(type=0, code=8, id=8)/Raw(b"odd"))
wrpcap("inside.pcap", inside)
wrpcap("outside.pcap", outside)
"#;

/// What the collectors saw of one `dpuflow run --ipfix`.
struct Export {
    /// nfdump's flows: "src dst sport dport proto" → (packets, bytes), records summed.
    flows: BTreeMap<String, (u64, u64)>,
    /// Records nfdump listed per flow.
    records_of: BTreeMap<String, u64>,
    /// Records nfdump listed.
    records: u64,
    /// The flows the input holds, from `flows.txt` (none without it).
    want: BTreeMap<String, (u64, u64)>,
    /// Reads a metric of the scrape taken after the inputs were processed.
    metrics: String,
    /// The export as captured on loopback, and the UDP port it went to.
    pcap: String,
    port: u16,
}

impl Export {
    fn metric(&self, name: &str) -> u64 {
        metric(&self.metrics, name).unwrap_or_else(|| panic!("no {name} in:\n{}", self.metrics))
    }

    /// The series `name` of the collector the export went to.
    fn collector_metric(&self, name: &str) -> u64 {
        self.metric(&collector_series(name, self.port))
    }

    /// tshark's fields of each data record in the capture, `;`-separated per message
    /// (values of one message comma-separated).
    fn tshark(&self, fields: &[&str]) -> String {
        let decode = format!("udp.port=={},cflow", self.port);
        tshark_table(&self.pcap, &["-d", &decode], ';', fields)
    }

    /// tshark decodes the capture cleanly, and each data message's sequence number is the
    /// previous one plus the records it carried; returns the flow records seen.
    fn check_with_tshark(&self) -> u64 {
        let decode = format!("udp.port=={},cflow", self.port);
        let expert = tool_ok(
            "tshark",
            &["-r", &self.pcap, "-d", &decode, "-q", "-z", "expert"],
        );
        assert!(
            !expert.contains("Errors (") && !expert.contains("Warnings ("),
            "tshark: {expert}"
        );
        let mut expected_seq = 0u64;
        let mut records = 0u64;
        // Options records (the selector report, interface names, reliability statistics)
        // count too.
        let fields = [
            "cflow.sequence",
            "cflow.srcaddr",
            "cflow.srcaddrv6",
            "cflow.selector_algorithm",
            "cflow.if_name",
            "cflow.ignore_packets",
        ];
        for row in self.tshark(&fields).lines() {
            let f: Vec<&str> = row.split(';').collect();
            let count = |v: &str| v.split(',').filter(|a| !a.is_empty()).count() as u64;
            let flows = count(f[1]) + count(f[2]);
            let options = count(f[3]) + count(f[4]) + count(f[5]);
            assert_eq!(
                f[0].parse::<u64>().expect("sequence"),
                expected_seq,
                "sequence gap at {row}"
            );
            expected_seq += flows + options;
            records += flows;
        }
        records
    }
}

/// Runs `pipeline` over `inputs` (port, capture in `dir`) with IPFIX export to nfcapd and
/// `flags` added, and reads back what it stored.
fn export(dir: &Scratch, pipeline: &str, inputs: &[(&str, &str)], flags: &[&str]) -> Export {
    export_to(dir, pipeline, inputs, flags, &[])
}

/// [`export`] to an nfcapd started with `nfcapd_flags` besides its address and store.
fn export_to(
    dir: &Scratch,
    pipeline: &str,
    inputs: &[(&str, &str)],
    flags: &[&str],
    nfcapd_flags: &[&str],
) -> Export {
    let store = dir.0.join("nfcapd");
    let (nfcapd, port) = nfcapd(&store, nfcapd_flags);
    // Capture the export on loopback for tshark.
    let mut tcpdump = Command::new("tcpdump")
        .args([
            "-i",
            "lo",
            "-Z",
            "root",
            "--immediate-mode",
            "-U",
            "-n",
            "-w",
            &dir.path("export.pcap"),
            "udp",
            "dst",
            "port",
            &port.to_string(),
        ])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("tcpdump");
    let mut line = String::new();
    let mut err = BufReader::new(tcpdump.stderr.take().expect("stderr"));
    while !line.contains("listening on") {
        line.clear();
        assert!(
            err.read_line(&mut line).expect("tcpdump stderr") > 0,
            "tcpdump exited"
        );
    }
    std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
    std::thread::sleep(Duration::from_millis(300));

    let metrics = format!("127.0.0.1:{}", free_tcp_port());
    let mut args = vec![
        "run".to_string(),
        pipeline.to_string(),
        "--metrics".to_string(),
        metrics.clone(),
        "--ipfix".to_string(),
        format!("127.0.0.1:{port}"),
    ];
    args.extend(flags.iter().map(|f| f.to_string()));
    for (name, file) in inputs {
        args.extend(["--in".to_string(), format!("{name}={}", dir.path(file))]);
    }
    let run = dpuflow_command()
        .args(&args)
        .stderr(Stdio::null())
        .spawn()
        .expect("dpuflow run");
    // The workers export when they have read the inputs, after writing their connection
    // tables (hundreds of MB for the stateful example, slow on a busy machine): wait for
    // every input packet to be counted and the records made, then for the exporter.
    let sent: usize = inputs.iter().map(|(_, f)| frames(&dir.path(f)).len()).sum();
    let deadline = Instant::now() + Duration::from_secs(30);
    let endpoint = metrics.parse().expect("addr");
    let mut metrics = loop {
        let scraped = get(endpoint, "/metrics");
        if let Some((200, body)) = &scraped {
            let received: u64 = body
                .lines()
                .filter(|l| l.starts_with("dpuflow_port_received_packets_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum();
            let records = metric(body, "dpuflow_flow_records_total").unwrap_or(0);
            if received == sent as u64 && records > 0 {
                break body.clone();
            }
        }
        assert!(
            Instant::now() < deadline,
            "dpuflow run never finished its inputs: {scraped:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    // Then until the exporter has sent what it was handed: its count of messages holds.
    let sent = collector_series("dpuflow_ipfix_messages_total", port);
    let messages = |body: &str| metric(body, &sent);
    loop {
        std::thread::sleep(Duration::from_millis(500));
        let Some((200, now)) = get(endpoint, "/metrics") else {
            panic!("the metrics endpoint stopped answering")
        };
        let settled = messages(&now) == messages(&metrics);
        metrics = now;
        if settled {
            break;
        }
        assert!(Instant::now() < deadline, "the export never settled");
    }
    stop(run);
    std::thread::sleep(Duration::from_millis(500));
    stop(nfcapd);
    stop(tcpdump);

    let stored = Stored::read(&store);
    let want = std::fs::read_to_string(dir.0.join("flows.txt"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[..5].join(" "),
                (f[5].parse().expect("n"), f[6].parse().expect("n")),
            )
        })
        .collect();
    Export {
        flows: stored.flows,
        records_of: stored.records_of,
        records: stored.records,
        want,
        metrics,
        pcap: dir.path("export.pcap"),
        port,
    }
}

/// An nfcapd storing what it receives under `store`, started with `flags` besides its
/// address and store, and the UDP port it listens on (127.0.0.1).
fn nfcapd(store: &std::path::Path, flags: &[&str]) -> (Child, u16) {
    let port = free_udp_port();
    std::fs::create_dir_all(store).expect("mkdir");
    let nfcapd = Command::new("nfcapd")
        .args([
            "-b",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-w",
            &store.display().to_string(),
            "-t",
            "3600",
        ])
        .args(flags)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nfcapd is required (Debian package nfdump; scripts/test installs it)");
    (nfcapd, port)
}

/// The series `name` of the collector at 127.0.0.1:`port`.
fn collector_series(name: &str, port: u16) -> String {
    format!("{name}{{collector=\"127.0.0.1:{port}\"}}")
}

/// What an nfcapd stored, as nfdump lists it.
struct Stored {
    /// "src dst sport dport proto" → (packets, bytes), records summed.
    flows: BTreeMap<String, (u64, u64)>,
    /// Records per flow.
    records_of: BTreeMap<String, u64>,
    records: u64,
}

impl Stored {
    fn read(store: &std::path::Path) -> Stored {
        let csv = tool_ok(
            "nfdump",
            &[
                "-R",
                &store.display().to_string(),
                "-q",
                "-o",
                "fmt:%sa,%da,%sp,%dp,%pr,%pkt,%byt",
            ],
        );
        Stored::parse(&csv)
    }

    fn parse(csv: &str) -> Stored {
        let mut flows: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        let mut records_of: BTreeMap<String, u64> = BTreeMap::new();
        for l in csv.lines().filter(|l| !l.trim().is_empty()) {
            let f: Vec<&str> = l.split(',').map(str::trim).collect();
            let proto = match f[4] {
                "UDP" => "17",
                "TCP" => "6",
                "ICMP" => "1",
                "ICMP6" => "58",
                p => p,
            };
            // nfdump shows an ICMP flow's icmpTypeCodeIPv4 (or IPv6) as its destination port,
            // `TYPE.CODE`.
            let dport = match f[3].split_once('.') {
                Some((kind, code)) if proto == "1" || proto == "58" => {
                    let n = |v: &str| v.parse::<u16>().expect("ICMP type and code");
                    (n(kind) << 8 | n(code)).to_string()
                }
                _ => f[3].to_owned(),
            };
            let key = format!("{} {} {} {} {}", f[0], f[1], f[2], dport, proto);
            *records_of.entry(key.clone()).or_default() += 1;
            let e = flows.entry(key).or_default();
            e.0 += f[5].parse::<u64>().expect("packets");
            e.1 += f[6].parse::<u64>().expect("bytes");
        }
        Stored {
            flows,
            records_of,
            records: csv.lines().filter(|l| !l.trim().is_empty()).count() as u64,
        }
    }
}

#[test]
fn nfdump_and_tshark_read_the_export() {
    let dir = Scratch::new("ipfix");
    scapy(
        &dir.0,
        &format!("{TRAFFIC}{FRAGMENTED_TRAFFIC}{COUNT_FLOWS}"),
    );
    let x = export(
        &dir,
        "pipelines/vxlan-gateway.pipe",
        &[("host", "host.pcap")],
        &["--workers", "2"],
    );
    assert_eq!(x.flows, x.want, "nfdump's flows differ from the input's");
    // The metrics agree: every record nfdump read was counted, no flow went untracked, and
    // the caches emptied at the end.
    assert_eq!(x.metric("dpuflow_flow_records_total"), x.records);
    assert_eq!(x.metric("dpuflow_flow_records_lost_total"), 0);
    assert_eq!(x.metric("dpuflow_flow_cache_full_packets_total"), 0);
    assert_eq!(x.metric("dpuflow_flow_cache_entries"), 0);
    assert_eq!(x.metric("dpuflow_flow_cache_limit"), 2 << 20);
    assert!(x.collector_metric("dpuflow_ipfix_messages_total") >= 2);
    assert_eq!(x.collector_metric("dpuflow_ipfix_send_failures_total"), 0);
    assert_eq!(x.check_with_tshark(), x.want.len() as u64);
    // The ports are named: interface 1 is `host`, 2 `uplink`.
    let names = x.tshark(&["cflow.if_name"]);
    let names: Vec<&str> = names.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(names, ["host,uplink"], "interface names");
}

/// Given two collectors, the export sends each every message: both nfcapds store every
/// flow of the input, exactly, and the metrics count each collector's messages.
#[test]
fn each_collector_receives_the_whole_export() {
    let dir = Scratch::new("ipfix-collectors");
    scapy(&dir.0, &format!("{TRAFFIC}{COUNT_FLOWS}"));
    let second = dir.0.join("nfcapd-second");
    let (nfcapd_second, port) = nfcapd(&second, &[]);
    let also = format!("127.0.0.1:{port}");
    let x = export(
        &dir,
        "pipelines/vxlan-gateway.pipe",
        &[("host", "host.pcap")],
        &["--workers", "1", "--ipfix", &also],
    );
    stop(nfcapd_second);
    assert_eq!(
        x.flows, x.want,
        "the first collector's flows differ from the input's"
    );
    let stored = Stored::read(&second);
    assert_eq!(stored.flows, x.want, "the second collector's flows differ");
    assert_eq!(stored.records, x.records);
    let sent = x.collector_metric("dpuflow_ipfix_messages_total");
    assert!(sent >= 2);
    let to_second = |name| x.metric(&collector_series(name, port));
    assert_eq!(to_second("dpuflow_ipfix_messages_total"), sent);
    assert_eq!(to_second("dpuflow_ipfix_send_failures_total"), 0);
}

/// Every flow of a large capture ends at once, when the input does: the export keeps to its
/// rate (`--ipfix-rate`; here 2,000 messages a second, as nfcapd shares the machine with
/// the other tests) instead of sending the thousands of messages as fast as the socket
/// takes them, and nfcapd receives every record (unpaced, nfcapd on a 2-core VM lost 60 %
/// of 200,000 flows' messages to its full receive buffer).
#[test]
fn a_burst_of_records_reaches_the_collector_whole() {
    const FLOWS: u64 = 100_000;
    let dir = Scratch::new("ipfix-burst");
    bench_capture(
        "pipelines/vxlan-gateway.pipe",
        "host",
        FLOWS,
        &dir.path("host.pcap"),
    );
    let x = export(
        &dir,
        "pipelines/vxlan-gateway.pipe",
        &[("host", "host.pcap")],
        &["--workers", "1", "--ipfix-rate", "2000"],
    );
    assert_eq!(x.collector_metric("dpuflow_ipfix_send_failures_total"), 0);
    assert_eq!(x.records, FLOWS, "records nfdump lists");
    assert_eq!(x.flows.len() as u64, FLOWS, "distinct flows nfdump lists");
    assert!(x.flows.values().all(|&(packets, _)| packets == 1));
    let paced: f64 = x
        .metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("dpuflow_ipfix_pacing_seconds_total ")?
                .parse()
                .ok()
        })
        .expect("dpuflow_ipfix_pacing_seconds_total");
    assert!(paced > 0.0, "the export never waited");
}

/// Flows a full flow cache has no room for go unexported; the collector is told how many
/// packets and bytes the records miss (RFC 7011 §4.2 reliability statistics), as the
/// metric counts them, and every flow that did get in is exact.
#[test]
fn a_full_flow_cache_is_reported_to_the_collector() {
    let dir = Scratch::new("ipfix-full");
    scapy(&dir.0, &format!("{TRAFFIC}{COUNT_FLOWS}"));
    let pipeline = dir.path("small-cache.pipe");
    let text = std::fs::read_to_string("pipelines/vxlan-gateway.pipe").expect("pipeline");
    std::fs::write(&pipeline, format!("{text}\ntelemetry {{ flow_cache 8 }}\n")).expect("write");
    let x = export(
        &dir,
        &pipeline,
        &[("host", "host.pcap")],
        &["--workers", "1"],
    );
    assert_eq!(x.flows.len(), 8, "the cache's flows: {:?}", x.flows);
    for (flow, counts) in &x.flows {
        assert_eq!(Some(counts), x.want.get(flow), "{flow}");
    }
    let total = |m: &BTreeMap<String, (u64, u64)>| {
        m.values().fold((0, 0), |(p, b), &(q, c)| (p + q, b + c))
    };
    let (sent, exported) = (total(&x.want), total(&x.flows));
    let missed = (sent.0 - exported.0, sent.1 - exported.1);
    assert_eq!(x.metric("dpuflow_flow_cache_full_packets_total"), missed.0);
    let reports = x.tshark(&["cflow.ignore_packets", "cflow.ignore_octets"]);
    let last = reports.lines().rfind(|l| l.len() > 1);
    assert_eq!(
        last,
        Some(format!("{};{}", missed.0, missed.1).as_str()),
        "{reports}"
    );
    assert_eq!(x.check_with_tshark(), 8);
}

/// Where the pipeline tracks connections, their entries are the records of the packets
/// they count; the flow cache keeps only the rest (here the packets dropped before a
/// commit). nfdump still lists every flow exactly, and the TCP connection that closed is
/// reported as ended (flowEndReason 3), which only conntrack knows.
#[test]
fn connections_are_the_records_of_a_stateful_pipeline() {
    let dir = Scratch::new("ipfix-ct");
    scapy(&dir.0, &format!("{FIREWALL_TRAFFIC}{COUNT_FLOWS}"));
    let x = export(
        &dir,
        "pipelines/stateful-firewall.pipe",
        &[("inside", "inside.pcap"), ("outside", "outside.pcap")],
        &["--workers", "2"],
    );
    assert_eq!(x.flows, x.want, "nfdump's flows differ from the input's");
    assert_eq!(x.metric("dpuflow_flow_records_total"), x.records);
    assert_eq!(x.metric("dpuflow_flow_records_lost_total"), 0);
    // The answers, whole and in fragments, are the connection's one record that way.
    assert_eq!(
        x.records_of.get("198.51.100.53 10.0.0.2 53 5353 17"),
        Some(&1),
        "{:?}",
        x.records_of
    );
    // Echo requests and replies (types 8 and 0, ICMPv6 128 and 129), and the port
    // unreachable (3, code 3).
    for icmp in [
        "10.0.0.1 198.51.100.1 0 2048 1",
        "198.51.100.1 10.0.0.1 0 0 1",
        "198.51.100.53 10.0.0.2 0 771 1",
        "2001:db8::5 2001:db8:1::10 0 32768 58",
        "2001:db8:1::10 2001:db8::5 0 33024 58",
    ] {
        assert!(x.flows.contains_key(icmp), "{icmp}: {:?}", x.flows);
    }
    x.check_with_tshark();
    // Per record: source address, end reason, firewall event (3: denied); template-only
    // messages give empty rows. tshark lists a message's IPv4 and IPv6 source addresses
    // apart: a record's protocol says which list its address is next in (the only IPv6
    // records here are ICMPv6, protocol 58).
    let rows = x.tshark(&[
        "cflow.protocol",
        "cflow.srcaddr",
        "cflow.srcaddrv6",
        "cflow.flow_end_reason",
        "cflow.firewall_event",
    ]);
    let mut records = Vec::new();
    for row in rows.lines().filter(|r| !r.starts_with(';')) {
        let f: Vec<Vec<&str>> = row.split(';').map(|v| v.split(',').collect()).collect();
        let (mut v4, mut v6) = (f[1].iter(), f[2].iter());
        for ((proto, reason), event) in f[0].iter().zip(&f[3]).zip(&f[4]) {
            let src = if *proto == "58" { v6.next() } else { v4.next() };
            records.push((*src.expect("an address per record"), *reason, *event));
        }
    }
    assert!(
        records.iter().any(|r| r.0 == "2001:db8::5"),
        "the ICMPv6 records: {records:?}"
    );
    assert!(
        records.contains(&("10.0.0.1", "3", "2")),
        "the reset connection ended: {records:?}"
    );
    for (src, _, event) in &records {
        let dropped = ["203.0.113.9", "10.0.0.3", "198.51.100.7"].contains(src);
        assert_eq!(*event == "3", dropped, "{records:?}");
    }
}

/// With `--ipfix-sampling 4` the flow cache counts one packet at a random place in every
/// four it sees (random n-out-of-N, RFC 5475 §5.2.1): nfdump lists only flows of the input,
/// none with more packets than were sent, each packet with its flow's size, and as many
/// packets in all as there are windows of four (one more if the last, partial window's
/// pick fell inside it). Their records carry selectorId 1, and the selector report says:
/// random n-out-of-N, one packet out of four. (Debian 12's nfdump 1.7.1 does not scale
/// the counts by the report; it lists the selected packets' counts as they are, and
/// scales them when nfcapd is given the rate, `-s 4`.)
#[test]
fn sampled_export_counts_one_packet_in_four_and_says_so() {
    const FLAGS: [&str; 6] = [
        "--workers",
        "1",
        "--ipfix-sampling",
        "4",
        "--ipfix-domain",
        "7",
    ];
    let dir = Scratch::new("ipfix-sampled");
    scapy(&dir.0, &format!("{TRAFFIC}{COUNT_FLOWS}"));
    let x = export(
        &dir,
        "pipelines/vxlan-gateway.pipe",
        &[("host", "host.pcap")],
        &FLAGS,
    );
    // Every message is of the domain asked for.
    let domains = x.tshark(&["cflow.od_id"]);
    assert!(
        domains.lines().all(|d| d == "7") && !domains.is_empty(),
        "observation domains: {domains}"
    );
    for (flow, &(packets, bytes)) in &x.flows {
        let &(sent, sent_bytes) = x.want.get(flow).expect("a flow of the input");
        assert!(packets <= sent, "{flow}: {packets} of {sent}");
        assert_eq!(bytes * sent, sent_bytes * packets, "{flow}: sizes");
    }
    let (all, counted): (u64, u64) = (
        x.want.values().map(|w| w.0).sum(),
        x.flows.values().map(|f| f.0).sum(),
    );
    assert!(
        counted == all / 4 || counted == all.div_ceil(4),
        "{counted} of {all}"
    );
    // Told the rate, nfcapd scales every record of the exporter: right here, where all
    // come from the flow cache (a pipeline tracking connections exports theirs exact).
    let scaled_dir = Scratch::new("ipfix-sampled-scaled");
    for file in ["host.pcap", "flows.txt"] {
        std::fs::copy(dir.0.join(file), scaled_dir.0.join(file)).expect("copy");
    }
    let scaled = export_to(
        &scaled_dir,
        "pipelines/vxlan-gateway.pipe",
        &[("host", "host.pcap")],
        &FLAGS,
        &["-s", "4"],
    );
    assert!(
        scaled.flows.values().all(|f| f.0 % 4 == 0),
        "{:?}",
        scaled.flows
    );
    let estimate: u64 = scaled.flows.values().map(|f| f.0).sum();
    assert!(
        estimate == all / 4 * 4 || estimate == all.div_ceil(4) * 4,
        "{estimate} estimated of {all}"
    );
    assert_eq!(x.metric("dpuflow_flow_records_total"), x.records);
    assert_eq!(x.check_with_tshark(), x.records);
    let report = x.tshark(&[
        "cflow.selector_algorithm",
        "cflow.sampling_size",
        "cflow.sampling_population",
    ]);
    assert!(
        report.lines().any(|r| r == "3;1;4"),
        "no selector report: {report}"
    );
    let selectors = x.tshark(&["cflow.srcaddr", "cflow.selector_id"]);
    for row in selectors.lines().filter(|r| !r.starts_with(';')) {
        let (addrs, ids) = row.split_once(';').expect("two fields");
        let ids: Vec<&str> = ids.split(',').collect();
        assert_eq!(ids.len(), addrs.split(',').count(), "{row}");
        assert!(ids.iter().all(|&id| id == "1"), "{row}");
    }
}
