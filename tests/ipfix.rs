//! IPFIX export read by real collectors: nfcapd stores what `dpuflow run --ipfix` sends and
//! `nfdump` must list exactly the flows of the input with their packet and byte counts;
//! tshark decodes the same messages with no expert errors and no sequence-number gaps.

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
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "process did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Flows of the input: (src, dst, sport, dport, proto) → (packets, IP bytes).
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
flows = {}
for p in pkts:
    k = (p[IP].src, p[IP].dst, p.sport, p.dport, p[IP].proto)
    c = flows.get(k, (0, 0)); flows[k] = (c[0] + 1, c[1] + len(bytes(p[IP])))
open("flows.txt", "w").write("\n".join("%s %s %d %d %d %d %d" % (k + v) for k, v in flows.items()))
"#;

#[test]
fn nfdump_and_tshark_read_the_export() {
    let dir = Scratch::new("ipfix");
    scapy(&dir.0, TRAFFIC);
    let port = free_udp_port();
    let store = dir.0.join("nfcapd");
    std::fs::create_dir_all(&store).expect("mkdir");
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
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nfcapd is required (Debian package nfdump; scripts/test installs it)");
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
    let run = Command::new(env!("CARGO_BIN_EXE_dpuflow"))
        .args([
            "run",
            "pipelines/vxlan-gateway.pipe",
            "--in",
            &format!("host={}", dir.path("host.pcap")),
            "--metrics",
            &metrics,
            "--ipfix",
            &format!("127.0.0.1:{port}"),
            "--workers",
            "2",
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("dpuflow run");
    // The inputs are read in well under a second; the workers export when they finish.
    std::thread::sleep(Duration::from_secs(2));
    let (code, exposition) = get(metrics.parse().expect("addr"), "/metrics").expect("scrape");
    assert_eq!(code, 200);
    let value = |name: &str| -> u64 {
        exposition
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in:\n{exposition}"))
    };
    stop(run);
    std::thread::sleep(Duration::from_millis(500));
    stop(nfcapd);
    stop(tcpdump);

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
    let mut got: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for l in csv.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = l.split(',').map(str::trim).collect();
        let proto = match f[4] {
            "UDP" => "17",
            "TCP" => "6",
            p => p,
        };
        let key = format!("{} {} {} {} {}", f[0], f[1], f[2], f[3], proto);
        let e = got.entry(key).or_default();
        e.0 += f[5].parse::<u64>().expect("packets");
        e.1 += f[6].parse::<u64>().expect("bytes");
    }
    let want: BTreeMap<String, (u64, u64)> = std::fs::read_to_string(dir.0.join("flows.txt"))
        .expect("flows")
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[..5].join(" "),
                (f[5].parse().expect("n"), f[6].parse().expect("n")),
            )
        })
        .collect();
    assert_eq!(got, want, "nfdump's flows differ from the input's");
    // The metrics agree: every record nfdump read was counted, no flow went untracked, and
    // the caches emptied at the end.
    let records = csv.lines().filter(|l| !l.trim().is_empty()).count() as u64;
    assert_eq!(value("dpuflow_flow_records_total"), records);
    assert_eq!(value("dpuflow_flow_cache_full_packets_total"), 0);
    assert_eq!(value("dpuflow_flow_cache_entries"), 0);
    assert_eq!(value("dpuflow_flow_cache_limit"), 2 << 20);

    // tshark: decodes cleanly, and each data message's sequence number is the previous
    // one plus the records it carried.
    let pcap = dir.path("export.pcap");
    let decode = format!("udp.port=={port},cflow");
    let expert = tool_ok(
        "tshark",
        &["-r", &pcap, "-d", &decode, "-q", "-z", "expert"],
    );
    assert!(
        !expert.contains("Errors (") && !expert.contains("Warnings ("),
        "tshark: {expert}"
    );
    let rows = tool_ok(
        "tshark",
        &[
            "-r",
            &pcap,
            "-d",
            &decode,
            "-T",
            "fields",
            "-E",
            "separator=;",
            "-e",
            "cflow.sequence",
            "-e",
            "cflow.srcaddr",
        ],
    );
    let mut expected_seq = 0u64;
    let mut records = 0u64;
    for row in rows.lines() {
        let (seq, addrs) = row.split_once(';').expect("two fields");
        let n = addrs.split(',').filter(|a| !a.is_empty()).count() as u64;
        assert_eq!(
            seq.parse::<u64>().expect("sequence"),
            expected_seq,
            "sequence gap at {row}"
        );
        expected_seq += n;
        records += n;
    }
    assert_eq!(records, want.len() as u64);
}
