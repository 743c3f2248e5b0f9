//! Helpers shared by the integration tests: running dpuflow and the peer tools, scratch
//! directories, reading captures.

#![allow(dead_code)]

use dpuflow::io::pcap::CaptureReader;
use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// A command that runs the dpuflow binary: itself, or through the emulator named by
/// `DPUFLOW_RUNNER` (its words, as `qemu-aarch64-static -L /usr/aarch64-linux-gnu`) where
/// the binary was built for another architecture (scripts/test-arm64).
pub fn dpuflow_command() -> Command {
    let bin = env!("CARGO_BIN_EXE_dpuflow");
    let runner = std::env::var("DPUFLOW_RUNNER").unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(emulator) => {
            let mut c = Command::new(emulator);
            c.args(words).arg(bin);
            c
        }
        None => Command::new(bin),
    }
}

/// Runs the dpuflow binary.
pub fn dpuflow(args: &[&str]) -> Output {
    dpuflow_command().args(args).output().expect("run dpuflow")
}

/// Runs dpuflow and fails the test with its stderr unless it succeeds; returns stdout.
pub fn dpuflow_ok(args: &[&str]) -> String {
    let out = dpuflow(args);
    assert!(
        out.status.success(),
        "dpuflow {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Writes `flows` flows of the synthetic traffic `dpuflow bench` makes for `port` of
/// `pipeline` to the capture `path`, one packet each.
pub fn bench_capture(pipeline: &str, port: &str, flows: u64, path: &str) {
    let flows = flows.to_string();
    dpuflow_ok(&[
        "bench", pipeline, "--port", port, "--flows", &flows, "--write", path,
    ]);
}

/// Runs an external tool that must be installed (scripts/test installs them); a missing
/// tool fails the test, it never skips.
pub fn tool(name: &str, args: &[&str]) -> Output {
    Command::new(name)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("`{name}` is required (scripts/test installs it): {e}"))
}

pub fn tool_ok(name: &str, args: &[&str]) -> String {
    let out = tool(name, args);
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Debian's Python, which has scapy (python3-scapy); not whatever `python3` is first on
/// the PATH.
pub const PYTHON: &str = "/usr/bin/python3";

/// Runs a Python script with scapy available, in `dir`.
/// What every scapy script starts with. An IPv6 frame built without a destination MAC
/// would have scapy solicit its neighbour, a second's wait per frame for a reply that
/// never comes (it then uses broadcast): it gets broadcast at once.
const SCAPY_PRELUDE: &str = "from scapy.all import *
from scapy.contrib.geneve import GENEVE, GeneveOptions
conf.neighbor.register_l3(Ether, IPv6, lambda l2, l3: 'ff:ff:ff:ff:ff:ff')
";

pub fn scapy(dir: &Path, script: &str) {
    let out = Command::new(PYTHON)
        .arg("-c")
        .arg(format!("{SCAPY_PRELUDE}{script}"))
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("{PYTHON} is required (Debian python3-scapy): {e}"));
    assert!(
        out.status.success(),
        "scapy script failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A fresh scratch directory, removed when dropped.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("dpuflow-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }

    pub fn path(&self, file: &str) -> String {
        self.0.join(file).display().to_string()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Every frame of a capture file.
pub fn frames(path: &str) -> Vec<Vec<u8>> {
    let mut r = CaptureReader::open(Path::new(path)).expect("open capture");
    let mut out = Vec::new();
    while let Some(f) = r.next_with(|_, data| data.to_vec()) {
        out.push(f.expect("read frame"));
    }
    out
}

/// tshark's expert-info summary of a capture, with checksum validation on.
pub fn tshark_expert(path: &str) -> String {
    tool_ok(
        "tshark",
        &[
            "-r",
            path,
            "-q",
            "-z",
            "expert",
            "-o",
            "ip.check_checksum:TRUE",
            "-o",
            "udp.check_checksum:TRUE",
            "-o",
            "tcp.check_checksum:TRUE",
        ],
    )
}

/// Asserts tshark reports no errors or warnings (malformed packets, bad checksums).
pub fn assert_tshark_clean(path: &str) {
    let expert = tshark_expert(path);
    assert!(
        !expert.contains("Errors (") && !expert.contains("Warnings ("),
        "tshark found problems in {path}:\n{expert}"
    );
}

/// tshark fields, one line per packet, comma-separated.
pub fn tshark_fields(path: &str, fields: &[&str]) -> Vec<String> {
    tshark_table(path, &[], ',', fields)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// tshark's `fields` output: one line per packet `options` (`-o`, `-Y`, `-d`, …) leave,
/// the fields separated by `separator`.
pub fn tshark_table(path: &str, options: &[&str], separator: char, fields: &[&str]) -> String {
    let separator = format!("separator={separator}");
    let mut args = vec!["-r", path];
    args.extend(options);
    args.extend(["-T", "fields", "-E", &separator]);
    for f in fields {
        args.extend(["-e", f]);
    }
    tool_ok("tshark", &args)
}

/// An HTTP GET: the status code and body, or `None` when nothing answered.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    scrape(addr, path).ok()
}

/// [`get`], or what went wrong: a test that expects an answer says why it had none.
pub fn scrape(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| format!("send to {addr}: {e}"))?;
    let mut out = String::new();
    s.read_to_string(&mut out)
        .map_err(|e| format!("answer from {addr} (5 s allowed): {e}"))?;
    let code = out.split_whitespace().nth(1).and_then(|c| c.parse().ok());
    match (code, out.split_once("\r\n\r\n")) {
        (Some(code), Some((_, body))) => Ok((code, body.to_owned())),
        _ => Err(format!("not an HTTP answer: {out:?}")),
    }
}

/// The value of an unlabelled series in a Prometheus exposition.
pub fn metric(body: &str, name: &str) -> Option<u64> {
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Makes network namespaces of a test's own (unique names); fails the test, saying that it
/// needs root, when it cannot.
pub fn add_netns(names: &[&str]) {
    for n in names {
        let out = tool("ip", &["netns", "add", n]);
        assert!(
            out.status.success(),
            "ip netns add {n} (this test needs root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Removes network namespaces, whatever state they are in (for `Drop`).
pub fn del_netns(names: &[&str]) {
    for n in names {
        let _ = Command::new("ip").args(["netns", "del", n]).status();
    }
}

/// Runs a command in namespace `ns` and returns its output; fails the test unless it
/// succeeds.
pub fn in_netns(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["netns", "exec", ns];
    full.extend_from_slice(args);
    tool_ok("ip", &full)
}

/// The series of an exposition, one per sample line: name and labels.
pub fn series(body: &str) -> Vec<&str> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.rsplit_once(' ').expect("sample").0)
        .collect()
}

/// promtool finds nothing to report in `body`, and what promtool does not check holds: no
/// series twice, every histogram ends with `+Inf`.
pub fn assert_clean_exposition(body: &str) {
    // promtool reads the exposition on stdin and prints nothing when it is clean.
    let mut p = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is required (Debian package prometheus; scripts/test installs it)");
    p.stdin
        .take()
        .expect("stdin")
        .write_all(body.as_bytes())
        .expect("write");
    let out = p.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // What promtool does not check: no series twice, every histogram ends with +Inf.
    let all = series(body);
    let unique: HashSet<&&str> = all.iter().collect();
    assert_eq!(unique.len(), all.len(), "a series appears twice");
    for hist in body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" histogram"))
    {
        // Each of the histogram's series (a `_count` line each) has its +Inf bucket.
        let counts = format!("{hist}_count");
        for line in body.lines().filter(|l| l.starts_with(&counts)) {
            let labels = line[counts.len()..].split(' ').next().unwrap_or_default();
            let inf = match labels.strip_suffix('}') {
                Some(l) => format!("{hist}_bucket{l},le=\"+Inf\"}}"),
                None => format!("{hist}_bucket{{le=\"+Inf\"}}"),
            };
            assert!(body.contains(&inf), "{hist}{labels} has no +Inf bucket");
        }
    }
}

/// How `child` exited, waiting at most `limit` for it; the test fails, saying `what`, if it
/// runs on past that.
pub fn exit_within(
    child: &mut std::process::Child,
    limit: Duration,
    what: &str,
) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The CPUs each thread of process `pid` may run on, by thread name, as Linux lists them
/// (`Cpus_allowed_list`). A short-lived thread may end between the listing and the reads:
/// it is left out.
pub fn thread_cpus(pid: u32) -> std::collections::BTreeMap<String, String> {
    let mut placed = std::collections::BTreeMap::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks") {
        let path = task.expect("task").path();
        let (Ok(name), Ok(status)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("status")),
        ) else {
            continue;
        };
        if let Some(cpus) = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        {
            placed.insert(name.trim().to_owned(), cpus.trim().to_owned());
        }
    }
    placed
}

/// A TCP port on 127.0.0.1 that nothing listened on a moment ago, and that no other
/// test of this process is given. Below Linux's ephemeral range (32768 up), so no
/// client's connection takes it between now and when a server binds it, as one could
/// with a port the kernel picked (`bind` to port 0); each test process starts at a place
/// of its own, so parallel runs seldom meet.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    const FIRST: u16 = 10_000;
    const PORTS: u16 = 22_000;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let start = (std::process::id() % u32::from(PORTS)) as u16;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = FIRST + (start.wrapping_add(n) % PORTS);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// `read` until it ends other than with EINTR, which a read with a timeout ends with when
/// the test's process is stopped and continued (signal(7)), as a machine's manager may do.
pub fn uninterrupted<T>(mut read: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    loop {
        match read() {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            r => return r,
        }
    }
}

/// Stops a child process when dropped, so a failing test leaves nothing running.
pub struct Running(pub std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// What a service manager hears on its notification socket (sd_notify(3)).
pub struct Manager(std::os::unix::net::UnixDatagram);

impl Manager {
    /// A notification socket bound at `path`, each datagram awaited for ten seconds.
    pub fn bind(path: &str) -> Manager {
        let socket = std::os::unix::net::UnixDatagram::bind(path).expect("bind");
        socket
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Manager(socket)
    }

    /// The next datagram, within ten seconds.
    pub fn next(&self) -> String {
        let mut buf = [0; 4096];
        let n = uninterrupted(|| self.0.recv(&mut buf)).expect("a notification within ten seconds");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    /// The datagrams up to and including the first that `pred` accepts.
    pub fn until(&self, pred: impl Fn(&str) -> bool) -> Vec<String> {
        let mut heard = Vec::new();
        loop {
            let d = self.next();
            let done = pred(&d);
            heard.push(d);
            if done {
                return heard;
            }
        }
    }
}

/// A test CA and what it signs with openssl: `server.pem`/`server.key` for 127.0.0.1,
/// `client.pem`/`client.key` for a client, and `node.pem`/`node.key` for 127.0.0.1 as
/// both (a cluster node, a client of the others), all P-256.
pub fn certificates(dir: &Scratch) {
    let sh = |script: &str| {
        let out = Command::new("sh")
            .arg("-ec")
            .arg(script)
            .current_dir(dir.path(""))
            .output()
            .expect("`openssl` is required (scripts/test installs it)");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    sh("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout ca.key -out ca.pem -days 2 -subj /CN=dpuflow-test-ca \
        -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null");
    for (name, usage, san) in [
        ("server", "serverAuth", "subjectAltName=IP:127.0.0.1"),
        ("client", "clientAuth", "subjectAltName=DNS:inference-host"),
        (
            "node",
            "serverAuth,clientAuth",
            "subjectAltName=IP:127.0.0.1",
        ),
    ] {
        sh(&format!(
            "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
             -keyout {name}.key -out {name}.csr -subj /CN={name} 2>/dev/null
             printf 'basicConstraints=CA:FALSE\\nkeyUsage=digitalSignature\\n\
             extendedKeyUsage={usage}\\n{san}\\n' > {name}.ext
             openssl x509 -req -in {name}.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
             -out {name}.pem -days 2 -extfile {name}.ext 2>/dev/null"
        ));
    }
}
