//! The KV-cache service with real peers: qemu-nbd serves the storage target, redis-cli,
//! redis-benchmark and redis-py are the hosts putting and getting blocks.

mod common;
use common::*;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} never listened on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// qemu-nbd exporting `image` as `kv` on 127.0.0.1:`port`, to several clients at once.
struct NbdServer(Child);

impl NbdServer {
    fn start(image: &str, port: u16) -> NbdServer {
        let child = Command::new("qemu-nbd")
            .args(["-f", "raw", "-x", "kv", "-b", "127.0.0.1", "-p"])
            .arg(port.to_string())
            .args(["--persistent", "--shared=8", image])
            .stderr(Stdio::null())
            .spawn()
            .expect("`qemu-nbd` is required (scripts/test installs qemu-utils)");
        wait_for_port(port, "qemu-nbd");
        NbdServer(child)
    }
}

impl Drop for NbdServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `dpuflow run` on a pipeline whose only work is the KV-cache service.
struct KvService {
    child: Child,
    metrics: SocketAddr,
    port: u16,
}

impl KvService {
    fn start(dir: &Scratch, target: &str, capacity: &str) -> KvService {
        let port = free_port();
        let pipe = dir.path("kv.pipe");
        std::fs::write(
            &pipe,
            format!(
                "pipeline kv\nport fabric {{ driver pcap }}\n\
                 service kvcache {{ listen 127.0.0.1:{port}  target \"{target}\"  \
                 capacity {capacity}  block_size 64KiB }}\n\
                 pipe from_fabric root from fabric {{\n\
                     rule kv {{ match tcp.dst {port}  actions to kvcache }}\n\
                     default {{ actions drop }}\n}}\n"
            ),
        )
        .expect("write pipeline");
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let child = Command::new(env!("CARGO_BIN_EXE_dpuflow"))
            .args(["run", &pipe, "--metrics", &metrics.to_string()])
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn dpuflow run");
        wait_for_port(port, "the kvcache service");
        KvService {
            child,
            metrics,
            port,
        }
    }

    fn cli(&self, args: &[&str]) -> String {
        let port = self.port.to_string();
        let mut all = vec!["-p", &port];
        all.extend_from_slice(args);
        tool_ok("redis-cli", &all)
    }

    /// redis-cli with `input` on its standard input (`-x` makes it the last argument).
    fn cli_with(&self, args: &[&str], input: &[u8]) -> String {
        let mut child = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("`redis-cli` is required (scripts/test installs redis-tools)");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(input)
            .expect("write");
        let out = child.wait_with_output().expect("redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn metric(&self, name: &str) -> u64 {
        let (_, body) = get(self.metrics, "/metrics").expect("scrape");
        metric(&body, name).unwrap_or_else(|| panic!("no {name} in\n{body}"))
    }

    fn terminate(mut self) -> i32 {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.child.wait().expect("wait").code().unwrap_or(-1)
    }
}

/// Pseudo-random bytes, different for each `seed`.
fn value(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn hosts_put_and_get_blocks_stored_on_an_nbd_target() {
    let dir = Scratch::new("kv-nbd");
    let image = dir.path("export.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(64 << 20))
        .expect("image");
    let nbd_port = free_port();
    let nbd = NbdServer::start(&image, nbd_port);
    let kv = KvService::start(&dir, &format!("nbd://127.0.0.1:{nbd_port}/kv"), "32MiB");

    // A block of 1 MB, put and got back whole with redis-cli.
    let block = value(1_000_000, 1);
    assert_eq!(kv.cli_with(&["-x", "SET", "layer0"], &block).trim(), "OK");
    let back = tool(
        "redis-cli",
        &["-p", &kv.port.to_string(), "--raw", "GET", "layer0"],
    );
    assert_eq!(
        back.stdout.len(),
        block.len() + 1,
        "GET returned the wrong length"
    );
    assert!(
        back.stdout[..block.len()] == block[..],
        "GET returned other bytes"
    );
    assert_eq!(kv.cli(&["STRLEN", "layer0"]).trim(), "1000000");
    // The bytes went to the export, in the first blocks of a fresh store.
    let disk = std::fs::read(&image).expect("read image");
    assert!(
        disk[..block.len()] == block[..],
        "the export does not hold the block"
    );

    // redis-py, another client library: bytes values, pipelining, MSET/MGET.
    let script = format!(
        r#"
import os, redis
r = redis.Redis(host="127.0.0.1", port={port})
vals = {{f"blk{{i}}".encode(): os.urandom(65536 * (i % 3) + i) for i in range(20)}}
p = r.pipeline(transaction=False)
for k, v in vals.items():
    p.set(k, v)
assert all(p.execute())
assert r.mget(list(vals)) == list(vals.values())
assert r.mset({{b"a": b"1", b"b": b""}})
assert r.mget([b"a", b"missing", b"b"]) == [b"1", None, b""]
assert r.exists(b"a", b"b", b"missing") == 2
assert r.delete(b"a", b"missing") == 1
assert r.get(b"missing") is None
assert r.set(b"blk0", b"x", nx=True) is None
print("ok")
"#,
        port = kv.port
    );
    let out = tool(PYTHON, &["-c", &script]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "redis-py: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // redis-benchmark: 64 KiB values over random keys, many more than 32 MiB hold: the
    // least recently used are evicted, nothing fails.
    let port = kv.port.to_string();
    let csv = tool_ok(
        "redis-benchmark",
        &[
            "-p", &port, "-t", "set,get", "-n", "2000", "-d", "65536", "-r", "5000", "-c", "8",
            "--csv",
        ],
    );
    for test in ["\"SET\"", "\"GET\""] {
        let line = csv
            .lines()
            .find(|l| l.starts_with(test))
            .unwrap_or_else(|| panic!("no {test} in {csv}"));
        let rps: f64 = line
            .split(',')
            .nth(1)
            .expect("rps")
            .trim_matches('"')
            .parse()
            .expect("number");
        assert!(rps > 0.0, "{line}");
    }
    assert!(kv.metric("dpuflow_kvcache_evictions_total{service=\"kvcache\"}") > 0);
    assert!(kv.metric("dpuflow_kvcache_used_bytes{service=\"kvcache\"}") <= 32 << 20);
    assert_eq!(
        kv.metric("dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}"),
        0
    );
    assert!(
        kv.metric("dpuflow_kvcache_commands_total{service=\"kvcache\",command=\"set\"}") >= 2000
    );

    // The target restarts: reads fail meanwhile, then the service carries on, its index
    // and the export's bytes intact.
    assert_eq!(
        kv.cli_with(&["-x", "SET", "survivor"], b"still here")
            .trim(),
        "OK"
    );
    drop(nbd);
    assert!(kv
        .cli(&["GET", "survivor"])
        .contains("ERR storage read failed"));
    let _nbd = NbdServer::start(&image, nbd_port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv.cli(&["GET", "survivor"]).trim() != "still here" {
        assert!(Instant::now() < deadline, "the service never reconnected");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(kv.metric("dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}") >= 1);
    assert_eq!(kv.terminate(), 0);
}

#[test]
fn a_local_file_target_is_created_and_filled() {
    let dir = Scratch::new("kv-file");
    let file = dir.path("blocks.img");
    let kv = KvService::start(&dir, &format!("file://{file}"), "4MiB");
    let block = value(200_000, 2);
    assert_eq!(kv.cli_with(&["-x", "SET", "k"], &block).trim(), "OK");
    let disk = std::fs::read(&file).expect("read target");
    assert_eq!(disk.len(), 4 << 20);
    assert!(disk[..block.len()] == block[..]);
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "1");
    assert_eq!(kv.terminate(), 0);
}

#[test]
fn an_unreachable_or_unsupported_target_fails_the_start() {
    let dir = Scratch::new("kv-refused");
    for (target, says) in [
        (
            format!("nbd://127.0.0.1:{}/kv", free_port()),
            "Connection refused",
        ),
        (
            "nvme-tcp://127.0.0.1:4420/nqn.2026-11.io.dpuflow:kv".to_owned(),
            "NVMe/TCP targets are not supported yet",
        ),
    ] {
        let pipe = dir.path("kv.pipe");
        std::fs::write(
            &pipe,
            format!(
                "pipeline kv\nport fabric {{ driver pcap }}\n\
                 service kvcache {{ listen 127.0.0.1:{}  target \"{target}\"  capacity 1MiB }}\n\
                 pipe p root from fabric {{ default {{ actions to kvcache }} }}\n",
                free_port()
            ),
        )
        .expect("write pipeline");
        let out = dpuflow(&["run", &pipe]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says),
            "{target}: {err}"
        );
    }
}
