//! The KV-cache service with real peers: qemu-nbd, nbdkit (where a target must fail on
//! cue) and the Linux kernel's nvmet-tcp serve the storage targets; redis-cli,
//! redis-benchmark and redis-py are the hosts putting and getting blocks.

mod common;
use common::*;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn wait_for_port(port: u16, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{what} never listened on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// qemu-nbd exporting `image` as `kv` on 127.0.0.1:`port`, to several clients at once.
fn nbd_server(image: &str, port: u16) -> Running {
    nbd_server_with(image, port, &[])
}

/// [`nbd_server`] with more of qemu-nbd's options (which come last, so override).
fn nbd_server_with(image: &str, port: u16, options: &[&str]) -> Running {
    let mut qemu_nbd = Command::new("qemu-nbd");
    qemu_nbd
        .args(["-f", "raw", "-x", "kv", "-b", "127.0.0.1", "-p"])
        .arg(port.to_string())
        .args(["--persistent", "--shared=8"])
        .args(options)
        .arg(image);
    serving(qemu_nbd, port, "qemu-nbd", "qemu-utils")
}

/// nbdkit serving on `port`, as `args` say (its filters, plugin and their parameters):
/// an NBD server whose faults a test can choose.
fn nbdkit_server(port: u16, args: &[&str]) -> Running {
    let mut nbdkit = Command::new("nbdkit");
    nbdkit
        .args(["--foreground", "--ipaddr", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .args(args);
    serving(nbdkit, port, "nbdkit", "nbdkit")
}

/// `server` (the tool `name`, from the Debian package `package`) started and listening on
/// `port`.
fn serving(mut server: Command, port: u16, name: &str, package: &str) -> Running {
    let child = server
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("`{name}` is required (scripts/test installs {package}): {e}"));
    let mut running = Running(child);
    wait_for_port(port, name);
    // Something else answering on the port (taken between picking and binding it) would
    // make every later failure a puzzle.
    assert!(
        running.0.try_wait().expect("the server's status").is_none(),
        "{name} exited: port {port} taken?"
    );
    running
}

/// `dpuflow run` on a pipeline whose only work is the KV-cache service.
struct KvService {
    /// Killed when dropped: a test that fails midway leaves no service running.
    child: Running,
    metrics: SocketAddr,
    port: u16,
    /// The service's log, shown when a test fails.
    log: String,
}

impl Drop for KvService {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("the KV-cache service's log:\n{log}");
        }
    }
}

impl KvService {
    fn start(dir: &Scratch, target: &str, capacity: &str) -> KvService {
        KvService::start_with(dir, target, capacity, "")
    }

    /// [`KvService::start`] with more of the service block's options.
    fn start_with(dir: &Scratch, target: &str, capacity: &str, options: &str) -> KvService {
        KvService::spawn(dir, free_port(), target, capacity, options, None)
    }

    /// [`KvService::start_with`] listening on `port`, started with a soft limit of
    /// `soft_fd_limit` open files (the hard limit as it is), where given.
    fn spawn(
        dir: &Scratch,
        port: u16,
        target: &str,
        capacity: &str,
        options: &str,
        soft_fd_limit: Option<u32>,
    ) -> KvService {
        let pipe = write_pipe(dir, port, target, capacity, options);
        let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let mut command = match soft_fd_limit {
            None => dpuflow_command(),
            Some(n) => {
                let dpuflow = dpuflow_command();
                let mut sh = Command::new("sh");
                sh.args(["-c", &format!("ulimit -S -n {n} && exec \"$0\" \"$@\"")])
                    .arg(dpuflow.get_program())
                    .args(dpuflow.get_args());
                sh
            }
        };
        let log = dir.path("service.log");
        let child = command
            .args(["run", &pipe, "--metrics", &metrics.to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn dpuflow run");
        let mut service = KvService {
            child: Running(child),
            metrics,
            port,
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        // Its metrics endpoint starts just after its port: a test scrapes it at once.
        while TcpStream::connect(("127.0.0.1", port)).is_err()
            || TcpStream::connect(metrics).is_err()
        {
            let exited = service.child.0.try_wait().expect("the service's status");
            assert!(exited.is_none(), "the kvcache service exited: {exited:?}");
            assert!(
                Instant::now() < deadline,
                "the kvcache service never listened"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        service
    }

    /// Rewrites its pipeline file (in `dir`, as [`KvService::spawn`] wrote it) with
    /// `options`, sends SIGHUP and waits for the reload to succeed.
    fn reload(&self, dir: &Scratch, target: &str, capacity: &str, options: &str) {
        write_pipe(dir, self.port, target, capacity, options);
        let reloads = "dpuflow_pipeline_reloads_total{result=\"success\"}";
        let before = self.metric(reloads);
        tool_ok("kill", &["-HUP", &self.child.0.id().to_string()]);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.metric(reloads) == before {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            assert!(Instant::now() < deadline, "no reload: {log}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// redis-cli's `--raw` output of `GET key`: the value's bytes and a newline.
    fn get_raw(&self, key: &str) -> std::process::Output {
        tool(
            "redis-cli",
            &["-p", &self.port.to_string(), "--raw", "GET", key],
        )
    }

    /// Whether `GET key` gives `value`'s bytes exactly (redis-cli adds a newline).
    fn reads_back(&self, key: &str, value: &[u8]) -> bool {
        let back = self.get_raw(key);
        back.stdout.len() == value.len() + 1 && back.stdout[..value.len()] == value[..]
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
        let (_, body) = scrape(self.metrics, "/metrics").unwrap_or_else(|e| panic!("scrape: {e}"));
        metric(&body, name).unwrap_or_else(|| panic!("no {name} in\n{body}"))
    }

    /// The service's resident memory once it is below `bound`, or as it is at `deadline`.
    fn resident_once_below(&self, bound: u64, deadline: Instant) -> u64 {
        loop {
            let rss = self.metric("process_resident_memory_bytes");
            if rss < bound || Instant::now() > deadline {
                return rss;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops it as a crash would.
    fn kill(mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
    }

    fn terminate(mut self) -> i32 {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.0.id().to_string()])
            .status();
        self.child.0.wait().expect("wait").code().unwrap_or(-1)
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

/// Runs a redis-py `script`, which prints "ok" when all its checks held.
fn redis_py_ok(script: &str, what: &str) {
    let out = tool(PYTHON, &["-c", script]);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "redis-py, {what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// What hosts do, checked end to end: a block put with redis-cli lands on the target's
/// `image` and comes back whole (2.5 MB: more than one NVMe command carries, so several
/// travel at once), and once a byte of it changes on the target, as a miss; redis-py's
/// pipelines and multi-key commands, and its asyncio client as LMCache drives it; then
/// redis-benchmark puts `requests` 64 KiB values over many more keys than 32 MiB hold, one
/// at a time and 16 a write, so the least recently used are evicted, and nothing fails;
/// then large values in the blocks that churn left scattered come back whole.
fn hosts_put_and_get(kv: &KvService, image: &str, requests: &str) {
    let block = value(2_500_000, 1);
    assert_eq!(kv.cli_with(&["-x", "SET", "layer0"], &block).trim(), "OK");
    let back = kv.get_raw("layer0");
    assert_eq!(
        back.stdout.len(),
        block.len() + 1,
        "GET returned the wrong length"
    );
    assert!(
        back.stdout[..block.len()] == block[..],
        "GET returned other bytes"
    );
    assert_eq!(kv.cli(&["STRLEN", "layer0"]).trim(), "2500000");
    assert_eq!(kv.cli(&["--scan", "--pattern", "layer*"]).trim(), "layer0");
    let big = kv.cli(&["--bigkeys"]);
    assert!(
        big.contains("Biggest string found '\"layer0\"' has 2500000 bytes"),
        "{big}"
    );
    // --memkeys ranks keys by the storage their values take: whole blocks.
    let stored = kv.cli(&["MEMORY", "USAGE", "layer0"]);
    let stored: u64 = stored
        .trim()
        .parse()
        .expect("MEMORY USAGE answers a number");
    assert!(
        (2_500_000..2_500_000 + 2 * 1024 * 1024).contains(&stored),
        "{stored}"
    );
    let mem = kv.cli(&["--memkeys"]);
    assert!(
        mem.contains(&format!(
            "Biggest string found '\"layer0\"' has {stored} bytes"
        )),
        "{mem}"
    );
    // The bytes went to the target's storage, in the first blocks of a fresh store after
    // the superblock's.
    let disk = std::fs::read(image).expect("read image");
    assert!(
        disk[65536..65536 + block.len()] == block[..],
        "the target does not hold the block"
    );
    // Bytes that change on the target under the service (a failing disk) are not served:
    // the value is answered as a miss and its key removed.
    {
        use std::os::unix::fs::FileExt;
        let disk = std::fs::OpenOptions::new()
            .write(true)
            .open(image)
            .expect("image");
        disk.write_all_at(&[!block[1_000_000]], 65536 + 1_000_000)
            .expect("write image");
    }
    assert_eq!(kv.get_raw("layer0").stdout, b"\n");
    assert_eq!(kv.cli(&["EXISTS", "layer0"]).trim(), "0");
    assert_eq!(
        kv.metric("dpuflow_kvcache_corrupt_values_total{service=\"kvcache\"}"),
        1
    );

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
assert sorted(r.scan_iter(match=b"blk*", count=3)) == sorted(vals)
assert sorted(r.keys(b"blk1?")) == [f"blk1{{i}}".encode() for i in range(10)]
print("ok")
"#,
        port = kv.port
    );
    redis_py_ok(&script, "pipelines and multi-key commands");

    // As LMCache's Redis connector uses a cache: redis-py's asyncio client over a pool of
    // connections (a semaphore keeps the chunks in flight to its size), each chunk's
    // bytes put before its metadata, then looked up by the metadata's key and read back.
    let script = format!(
        r#"
import asyncio, os, redis.asyncio as redis
async def main():
    pool = redis.ConnectionPool(host="127.0.0.1", port={port}, max_connections=48)
    r = redis.Redis(connection_pool=pool)
    sem = asyncio.Semaphore(48)
    chunks = {{f"chunk{{i}}": os.urandom(150_000 + 977 * i) for i in range(60)}}
    async def put(key, data):
        async with sem:
            await r.set(key + "kv_bytes", data)
            await r.set(key + "metadata", len(data).to_bytes(8, "little"))
    await asyncio.gather(*(put(k, d) for k, d in chunks.items()))
    async def exists(key):
        async with sem:
            return await r.exists(key + "metadata")
    held = await asyncio.gather(*(exists(k) for k in chunks))
    assert held == [1] * len(chunks), held
    async def get(key):
        async with sem:
            meta = await r.get(key + "metadata")
            data = await r.get(key + "kv_bytes")
        return int.from_bytes(meta, "little"), data
    back = await asyncio.gather(*(get(k) for k in chunks))
    for (k, d), (n, data) in zip(chunks.items(), back):
        assert n == len(d) and data == d, k
    assert await r.delete(*(k + "metadata" for k in chunks)) == len(chunks)
    await pool.disconnect()
    print("ok")
asyncio.run(main())
"#,
        port = kv.port
    );
    redis_py_ok(&script, "an asyncio client with many connections");

    let port = kv.port.to_string();
    // One request at a time from each client, then 16 a write (SETs and GETs that
    // arrive together go to the target together).
    for pipeline in ["1", "16"] {
        let csv = tool_ok(
            "redis-benchmark",
            &[
                "-p", &port, "-t", "set,get", "-n", requests, "-d", "65536", "-r", "5000", "-c",
                "8", "-P", pipeline, "--csv",
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
    }
    assert!(kv.metric("dpuflow_kvcache_evictions_total{service=\"kvcache\"}") > 0);
    assert!(kv.metric("dpuflow_kvcache_used_bytes{service=\"kvcache\"}") <= 32 << 20);
    assert_eq!(
        kv.metric("dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}"),
        0
    );
    let script = format!(
        r#"
import os, redis
r = redis.Redis(host="127.0.0.1", port={port})
vals = {{f"big{{i}}".encode(): os.urandom(3_000_000 + i) for i in range(3)}}
for k, v in vals.items():
    assert r.set(k, v)
assert r.mget(list(vals)) == list(vals.values())
print("ok")
"#,
        port = kv.port
    );
    redis_py_ok(&script, "large values");
    let sets = kv.metric("dpuflow_kvcache_commands_total{service=\"kvcache\",command=\"set\"}");
    let requests: u64 = requests.parse().expect("count");
    assert!(sets >= requests);
    let timed = kv.metric(
        "dpuflow_kvcache_request_duration_seconds_count{service=\"kvcache\",command=\"get\"}",
    );
    assert!(timed >= requests);
    // Every value's I/O is timed, and so is each wait for a target connection.
    let storage = |operation: &str| {
        kv.metric(&format!(
            "dpuflow_kvcache_storage_duration_seconds_count{{service=\"kvcache\",operation=\"{operation}\"}}"
        ))
    };
    let (reads, writes) = (storage("read"), storage("write"));
    assert!(writes >= requests, "{writes} writes");
    // A read for each GET that hit; one for all the values an MGET found.
    let hits = kv.metric("dpuflow_kvcache_hits_total{service=\"kvcache\"}");
    assert!(reads > 0 && reads < hits, "{reads} reads for {hits} hits");
    assert!(
        kv.metric("dpuflow_kvcache_connection_wait_seconds_count{service=\"kvcache\"}")
            >= reads + writes
    );
    let (_, body) = scrape(kv.metrics, "/metrics").unwrap_or_else(|e| panic!("scrape: {e}"));
    assert_clean_exposition(&body);
}

/// The value [`survives_a_restart`] stores: larger than the service keeps in memory, so
/// it is read from the target.
fn survivor() -> String {
    "still here;".repeat(100)
}

/// A value stored, then `target` stopped: reading it fails (the error names the storage)
/// until the target `restart` gives is back, within `seconds`; then the service reads it
/// again. The restarted target.
fn survives_a_restart<T, U>(
    kv: &KvService,
    target: T,
    restart: impl FnOnce() -> U,
    seconds: u64,
) -> U {
    let survivor = survivor();
    assert_eq!(
        kv.cli_with(&["-x", "SET", "survivor"], survivor.as_bytes())
            .trim(),
        "OK"
    );
    drop(target);
    assert!(kv
        .cli(&["GET", "survivor"])
        .contains("ERR storage read failed"));
    let back = restart();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while kv.cli(&["GET", "survivor"]).trim() != survivor {
        assert!(Instant::now() < deadline, "the service never reconnected");
        std::thread::sleep(Duration::from_millis(100));
    }
    back
}

/// qemu-nbd exporting a fresh image of 64 MiB in `dir`: the server, its port, and the
/// service's `target` for it.
fn nbd_export(dir: &Scratch) -> (Running, u16, String) {
    let image = image(dir, 64);
    let port = free_port();
    let server = nbd_server(&image, port);
    (server, port, format!("nbd://127.0.0.1:{port}/kv"))
}

/// A fresh, sparse disk image of `mib` MiB.
fn image(dir: &Scratch, mib: u64) -> String {
    let image = dir.path("export.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(mib << 20))
        .expect("image");
    image
}

#[test]
fn hosts_put_and_get_blocks_stored_on_an_nbd_target() {
    let dir = Scratch::new("kv-nbd");
    let image = image(&dir, 64);
    let nbd_port = free_port();
    let nbd = nbd_server(&image, nbd_port);
    let kv = KvService::start(&dir, &format!("nbd://127.0.0.1:{nbd_port}/kv"), "32MiB");
    hosts_put_and_get(&kv, &image, "2000");

    // The export's bytes and the service's index outlive the target's restart.
    let _nbd = survives_a_restart(&kv, nbd, || nbd_server(&image, nbd_port), 10);
    let errors = "dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}";
    let failed = kv.metric(errors);
    assert!(failed >= 1);
    // The pool's other connections died with the export: each is made afresh when next
    // used, and the request that found it dead is done on the fresh one.
    let port = kv.port.to_string();
    let args = [
        "-p", &port, "-t", "set,get", "-n", "400", "-d", "65536", "-r", "100", "-c", "8",
    ];
    tool_ok("redis-benchmark", &args);
    assert_eq!(kv.metric(errors), failed);
    let target = format!(
        "dpuflow_kvcache_target_errors_total{{service=\"kvcache\",target=\"nbd://127.0.0.1:{nbd_port}/kv\"}}"
    );
    assert_eq!(kv.metric(&target), failed);
    assert_eq!(kv.terminate(), 0);
}

/// A target that stops (qemu-nbd stopped with SIGSTOP: connected, silent, reading
/// nothing) fails requests once `io_timeout` has passed, a read waiting for its answer and
/// a large write waiting for the target to take its bytes (which fill the sockets'
/// buffers) alike, each with an error naming the timeout. The requests right after fail
/// at once (the next connection is tried two seconds after the one that failed); once
/// the target goes on, so do the requests.
#[test]
fn a_target_that_stops_answering_fails_requests_after_the_io_timeout() {
    let dir = Scratch::new("kv-io-timeout");
    let (nbd, _, target) = nbd_export(&dir);
    let kv = KvService::start_with(&dir, &target, "48MiB", "io_timeout 1s  connections 1");
    let mut host = Resp::connect(kv.port);
    host.stream
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let small = "s".repeat(4096);
    assert_eq!(host.call(&["SET", "small", &small]).trim(), "+OK");
    let large = "l".repeat(32 << 20);

    let pid = nbd.0.id().to_string();
    for (what, words) in [
        ("a read", vec!["GET", "small"]),
        ("a large write", vec!["SET", "large", &large]),
    ] {
        tool_ok("kill", &["-STOP", &pid]);
        let asked = Instant::now();
        let reply = host.call(&words);
        let waited = asked.elapsed();
        assert!(
            reply.starts_with("-ERR storage") && reply.contains("longer than 1s (io_timeout)"),
            "{what}: {reply}"
        );
        // The timeout on the connection, then again on a fresh one (whose NBD handshake
        // waits 5 s): well short of the default 30 s.
        assert!(waited < Duration::from_secs(20), "{what}: {waited:?}");
        let asked = Instant::now();
        let reply = host.call(&["GET", "small"]);
        assert!(
            reply.starts_with("-ERR storage read failed: cannot reach")
                && asked.elapsed() < Duration::from_secs(1),
            "right after {what}: {reply} in {:?}",
            asked.elapsed()
        );
        tool_ok("kill", &["-CONT", &pid]);
        let deadline = Instant::now() + Duration::from_secs(15);
        while host.call(&["GET", "small"]) != format!("$4096\r\n{small}\r\n") {
            assert!(
                Instant::now() < deadline,
                "{what}: the target never served again"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    assert_eq!(host.call(&["SET", "large", &large]).trim(), "+OK");
    let errors = kv.metric("dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}");
    assert!(errors >= 4, "{errors} storage errors");
    assert_eq!(kv.terminate(), 0);
}

/// Connections from hosts and to targets carry TCP keepalives, as `ss` shows them: a
/// host or target gone without closing its connection (powered off, cut off) ends it in
/// minutes rather than holding a thread or a pool connection for good.
#[test]
fn connections_to_hosts_and_targets_are_kept_alive() {
    let dir = Scratch::new("kv-keepalive");
    let (_nbd, nbd_port, target) = nbd_export(&dir);
    let kv = KvService::start_with(&dir, &target, "32MiB", "connections 1");
    let mut host = Resp::connect(kv.port);
    assert_eq!(host.call(&["PING"]), "+PONG\r\n");
    let timers = |filter: String| {
        tool_ok("ss", &["-tnoH", "state", "established", &filter])
            .lines()
            .map(|l| {
                l.split_once("timer:(")
                    .map_or("none", |(_, t)| t)
                    .to_owned()
            })
            .collect::<Vec<_>>()
    };
    // The service's end of the host's connection: probed after 5 minutes idle, as Redis's
    // default `tcp-keepalive 300`.
    let to_host = timers(format!("( sport = :{} )", kv.port));
    assert!(
        to_host.len() == 1 && to_host[0].starts_with("keepalive,") && to_host[0].contains("min"),
        "{to_host:?}"
    );
    // The service's end of its connection to the target: after a minute.
    let to_target = timers(format!("( dport = :{nbd_port} )"));
    assert!(
        to_target.len() == 1 && to_target[0].starts_with("keepalive,"),
        "{to_target:?}"
    );
    assert_eq!(kv.terminate(), 0);
}

/// A store striped over two NBD exports, each smaller than the store: a value's stripes
/// alternate between them as the layout says, the hosts' values fill more than either
/// holds, and a clean restart finds them over both.
#[test]
fn a_store_striped_over_two_nbd_targets_holds_more_than_either() {
    let dir = Scratch::new("kv-striped");
    let images: Vec<String> = ["a", "b"]
        .iter()
        .map(|n| {
            let image = dir.path(&format!("export-{n}.img"));
            std::fs::File::create(&image)
                .and_then(|f| f.set_len(24 << 20))
                .expect("image");
            image
        })
        .collect();
    let ports = [free_port(), free_port()];
    let mut servers: Vec<Running> = images
        .iter()
        .zip(ports)
        .map(|(image, port)| nbd_server(image, port))
        .collect();
    let options = format!("target \"nbd://127.0.0.1:{}/kv\"  stripe 256KiB", ports[1]);
    let first = format!("nbd://127.0.0.1:{}/kv", ports[0]);
    let kv = KvService::start_with(&dir, &first, "40MiB", &options);
    let block = value(2_500_000, 3);
    assert_eq!(kv.cli_with(&["-x", "SET", "layer0"], &block).trim(), "OK");
    assert!(kv.reads_back("layer0", &block), "GET returned other bytes");
    // In a fresh store the value starts in the block after the superblock's: stripe `s`
    // of the store is stripe `s / 2` of export `s % 2`.
    let disks: Vec<Vec<u8>> = images
        .iter()
        .map(|i| std::fs::read(i).expect("read"))
        .collect();
    let stripe = 256 << 10;
    let mut at = 65536;
    while at < 65536 + block.len() {
        let n = (stripe - at % stripe).min(65536 + block.len() - at);
        let (s, within) = (at / stripe, at % stripe);
        let there = s / 2 * stripe + within;
        assert!(
            disks[s % 2][there..there + n] == block[at - 65536..at - 65536 + n],
            "stripe {s} is not where the layout puts it"
        );
        at += n;
    }
    // One export goes away: the values wholly on the other are still served, those on it
    // fail naming it, and once it is back every value is served again.
    let small: Vec<Vec<u8>> = (0..8).map(|i| value(100_000, 10 + i)).collect();
    for (i, v) in small.iter().enumerate() {
        let key = format!("small{i}");
        assert_eq!(kv.cli_with(&["-x", "SET", &key], v).trim(), "OK");
    }
    let disks: Vec<Vec<u8>> = images
        .iter()
        .map(|i| std::fs::read(i).expect("read"))
        .collect();
    let on = |v: &[u8]| (0..2).find(|&d| disks[d].windows(v.len()).step_by(512).any(|w| w == v));
    let place: Vec<Option<usize>> = small.iter().map(|v| on(v)).collect();
    assert!(
        place.contains(&Some(0)) && place.contains(&Some(1)),
        "values wholly on each export: {place:?}"
    );
    drop(servers.remove(1));
    for (i, (v, d)) in small.iter().zip(&place).enumerate() {
        let key = format!("small{i}");
        match d {
            Some(0) => assert!(kv.reads_back(&key, v), "{key} from the export still up"),
            Some(1) => {
                let said = kv.cli(&["GET", &key]);
                let gone = format!("ERR storage read failed: nbd://127.0.0.1:{}/kv: ", ports[1]);
                assert!(said.starts_with(&gone), "{key}: {said}");
            }
            _ => {}
        }
    }
    let failed = place.iter().filter(|&&d| d == Some(1)).count() as u64;
    let errors = "dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}";
    assert_eq!(kv.metric(errors), failed);
    // Counted against the export that went away, none against the other.
    let on_target = |port: u16| {
        kv.metric(&format!(
            "dpuflow_kvcache_target_errors_total{{service=\"kvcache\",target=\"nbd://127.0.0.1:{port}/kv\"}}"
        ))
    };
    assert_eq!((on_target(ports[0]), on_target(ports[1])), (0, failed));
    // Back: once the next connection is tried (two seconds after the one that failed)
    // every value is served again, and the pool's other connections to the export that
    // went away are made afresh as they are next used, failing no request.
    servers.push(nbd_server(&images[1], ports[1]));
    let (back, v) = place
        .iter()
        .zip(&small)
        .enumerate()
        .find_map(|(i, (d, v))| (*d == Some(1)).then_some((format!("small{i}"), v)))
        .expect("a value on the export back");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !kv.reads_back(&back, v) {
        assert!(Instant::now() < deadline, "{back} never served again");
        std::thread::sleep(Duration::from_millis(100));
    }
    let failed = kv.metric(errors);
    for (i, v) in small.iter().enumerate() {
        let key = format!("small{i}");
        assert!(kv.reads_back(&key, v), "{key} once the export is back");
    }
    // 1000 values of 64 KiB over many keys: more than either export holds, so both fill.
    let port = kv.port.to_string();
    let args = [
        "-p", &port, "-t", "set", "-n", "1000", "-d", "65536", "-r", "100000", "-c", "8",
    ];
    tool_ok("redis-benchmark", &args);
    let used = kv.metric("dpuflow_kvcache_used_bytes{service=\"kvcache\"}");
    assert!(used > 24 << 20, "{used} bytes used");
    for image in &images {
        assert!(allocated(image) > 16 << 20, "{image} holds little");
    }
    assert_eq!(kv.metric(errors), failed);
    let last = value(1_000_000, 4);
    assert_eq!(kv.cli_with(&["-x", "SET", "last"], &last).trim(), "OK");
    let keys = kv.cli(&["DBSIZE"]);
    assert_eq!(kv.terminate(), 0);
    let kv = KvService::start_with(&dir, &first, "40MiB", &options);
    assert_eq!(kv.cli(&["DBSIZE"]), keys);
    assert!(
        kv.reads_back("last", &last),
        "GET after the restart returned other bytes"
    );
    assert_eq!(
        kv.metric("dpuflow_kvcache_corrupt_values_total{service=\"kvcache\"}"),
        0
    );
    assert_eq!(kv.terminate(), 0);
    // The second export replaced by a blank one: `kv inspect` names it, and the start
    // drops the values on it (none is then read from it and found corrupt) and keeps the
    // rest; unless the saved index itself was on it (where the save went depends on the
    // random keys above), when the start is empty.
    drop(servers.remove(1));
    std::fs::write(&images[1], vec![0u8; 24 << 20]).expect("blank export");
    servers.push(nbd_server(&images[1], ports[1]));
    let out = dpuflow(&["kv", "inspect", &dir.path("kv.pipe")]);
    let said = String::from_utf8_lossy(&out.stdout);
    let blank = format!("targets nbd://127.0.0.1:{}/kv do not hold", ports[1]);
    let index_lost = said.contains("the saved index is damaged; its next start is empty");
    assert!(
        out.status.success() && (said.contains(&blank) || index_lost),
        "{said}"
    );
    let kv = KvService::start_with(&dir, &first, "40MiB", &options);
    let before: u64 = keys.trim().parse().expect("DBSIZE");
    let after: u64 = kv.cli(&["DBSIZE"]).trim().parse().expect("DBSIZE");
    assert!(
        if index_lost {
            after == 0
        } else {
            0 < after && after < before
        },
        "{after} of {before} keys kept: {said}"
    );
    assert_eq!(
        kv.cli(&["GET", "last"]).trim(),
        "",
        "a value over both exports"
    );
    let port = kv.port.to_string();
    let args = [
        "-p", &port, "-t", "get", "-n", "2000", "-r", "100000", "-c", "8",
    ];
    tool_ok("redis-benchmark", &args);
    assert_eq!(
        kv.metric("dpuflow_kvcache_corrupt_values_total{service=\"kvcache\"}"),
        0
    );
    assert_eq!(kv.terminate(), 0);
}

/// A loop block device over a file, detached when dropped.
struct LoopDevice(String);

impl LoopDevice {
    /// `image` as a block device of `sector`-byte logical sectors (this needs root).
    fn over(image: &str, sector: u32) -> LoopDevice {
        let sector = sector.to_string();
        let args = ["--find", "--show", "--sector-size", &sector, image];
        LoopDevice(tool_ok("losetup", &args).trim().to_owned())
    }

    /// Bytes of the device the page cache holds (scripts/page-cached: only while the
    /// service holds it open, as the last close drops a device's page cache).
    fn page_cached_bytes(&self) -> u64 {
        let out = tool_ok("scripts/page-cached", &[&self.0]);
        out.trim()
            .parse()
            .unwrap_or_else(|_| panic!("scripts/page-cached said {out:?}"))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["--detach", &self.0]).status();
    }
}

/// A local NVMe device as the target, with a loop device of 4096-byte sectors standing in
/// for it: the service reads and writes it directly, in whole sectors from aligned
/// memory, and none of it stays in the page cache.
#[test]
fn hosts_put_and_get_blocks_stored_on_a_local_block_device() {
    let dir = Scratch::new("kv-block");
    let image = image(&dir, 64);
    let device = LoopDevice::over(&image, 4096);
    let target = format!("nvme://{}", device.0);
    let kv = KvService::start(&dir, &target, "32MiB");
    hosts_put_and_get(&kv, &image, "2000");
    assert_eq!(device.page_cached_bytes(), 0, "KV blocks in the page cache");
    let keys = kv.cli(&["DBSIZE"]);
    assert_eq!(kv.terminate(), 0);
    // The index saved at the stop, in whole sectors, is read back at the next start.
    let kv = KvService::start(&dir, &target, "32MiB");
    assert_eq!(kv.cli(&["DBSIZE"]), keys);
    let block = value(1_000_001, 9);
    assert_eq!(kv.cli_with(&["-x", "SET", "odd"], &block).trim(), "OK");
    assert!(kv.get_raw("odd").stdout[..block.len()] == block[..]);
    assert_eq!(device.page_cached_bytes(), 0, "KV blocks in the page cache");
    assert_eq!(kv.terminate(), 0);
    // Asked for, the page cache holds what the service writes.
    let kv = KvService::start_with(&dir, &target, "32MiB", "page_cache on");
    assert_eq!(kv.cli_with(&["-x", "SET", "cached"], &block).trim(), "OK");
    assert!(device.page_cached_bytes() >= block.len() as u64);
    assert_eq!(kv.terminate(), 0);
    // Blocks smaller than the device's sectors cannot be read or written directly.
    let says = "reads and writes in units of 4096 bytes: block_size 512 is not a multiple";
    assert_start_fails(&dir, &target, "block_size 512", says);
}

/// `page_cache off` has a file target read and written directly too.
#[test]
fn a_file_target_can_be_kept_out_of_the_page_cache() {
    let dir = Scratch::new("kv-uncached-file");
    let file = dir.path("blocks.img");
    let kv = KvService::start_with(&dir, &format!("file://{file}"), "8MiB", "page_cache off");
    let block = value(3_000_001, 3);
    assert_eq!(kv.cli_with(&["-x", "SET", "k"], &block).trim(), "OK");
    assert!(kv.get_raw("k").stdout[..block.len()] == block[..]);
    let cached = tool_ok("scripts/page-cached", &[&file]);
    assert_eq!(cached.trim(), "0", "the file's blocks in the page cache");
    assert!(std::fs::read(&file).expect("read target")[65536..65536 + block.len()] == block[..]);
    assert_eq!(kv.terminate(), 0);
}

/// The Linux kernel's NVMe/TCP target (nvmet-tcp), booted under QEMU by
/// scripts/nvmet-target, exporting a disk backed by `image` on this host.
fn nvmet_target(image: &str, port: u16) -> Running {
    let mut child = Command::new("scripts/nvmet-target")
        .arg(port.to_string())
        .arg(image)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run scripts/nvmet-target");
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out)
            .split(b'\n')
            .map_while(Result::ok)
        {
            if String::from_utf8_lossy(&line).contains("nvmet ready") {
                let _ = tx.send(());
            }
        }
    });
    let target = Running(child);
    // Built once (a kernel package fetched, an initramfs made), then booted under TCG.
    if rx.recv_timeout(Duration::from_secs(300)).is_err() {
        panic!("the NVMe/TCP target never came up (scripts/nvmet-target needs qemu-system-x86, busybox-static, cpio)");
    }
    target
}

/// The `io_timeout` of a service whose target is [`nvmet_target`]: a machine emulated
/// in full on cores the other tests share, whose flushes are fdatasyncs of its image on a
/// disk they share too, has kept a request waiting past the default 30 s (a real target
/// that did would have failed).
const EMULATED_TARGET_TIMEOUT: &str = "io_timeout 5m";

#[test]
fn hosts_put_and_get_blocks_stored_on_an_nvme_tcp_target() {
    let dir = Scratch::new("kv-nvme");
    let image = image(&dir, 64);
    let port = free_port();
    let target = nvmet_target(&image, port);
    let kv = KvService::start_with(
        &dir,
        &format!("nvme-tcp://127.0.0.1:{port}/nqn.2026-11.io.dpuflow:kv"),
        "32MiB",
        EMULATED_TARGET_TIMEOUT,
    );
    // The target runs in an emulated machine: fewer requests than against qemu-nbd.
    hosts_put_and_get(&kv, &image, "800");

    // The target's machine restarts: the service connects to new controllers and reads
    // what the disk kept.
    let _target = survives_a_restart(&kv, target, || nvmet_target(&image, port), 30);
    // A clean restart of the service keeps its index (saved, flushed, read back); if the
    // store was full, the least recently used key made room for the saved index.
    let keys: u64 = kv.cli(&["DBSIZE"]).trim().parse().expect("count");
    assert_eq!(kv.terminate(), 0);
    // Restarted with header and data digests: the kernel's target agrees to them and
    // checks every PDU this side sends, as this side checks the target's.
    let kv = KvService::start_with(
        &dir,
        &format!("nvme-tcp://127.0.0.1:{port}/nqn.2026-11.io.dpuflow:kv"),
        "32MiB",
        &format!("nvme_digest both  {EMULATED_TARGET_TIMEOUT}"),
    );
    let restored: u64 = kv.cli(&["DBSIZE"]).trim().parse().expect("count");
    assert!(
        restored == keys || restored + 1 == keys,
        "{keys} keys, {restored} restored"
    );
    assert_eq!(kv.cli(&["GET", "survivor"]).trim(), survivor());
    let block = value(2_500_000, 7);
    assert_eq!(kv.cli_with(&["-x", "SET", "digested"], &block).trim(), "OK");
    assert!(
        kv.reads_back("digested", &block),
        "GET with digests returned other bytes"
    );
    assert_eq!(
        kv.metric("dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}"),
        0
    );
    assert_eq!(kv.terminate(), 0);
}

/// Bytes of its file system that `file` takes (holes take none).
fn allocated(file: &str) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(file).expect("stat").blocks() * 512
}

/// With `discard on`, values deleted give their blocks back to the target: `image`, the
/// file behind it, takes its space back once the blocks are discarded (after the next
/// checkpoint, which must no longer name them), and values stored afterwards read back.
fn deleted_values_are_discarded(kv: &KvService, image: &str) {
    const VALUES: usize = 6;
    let blocks: Vec<Vec<u8>> = (0..VALUES)
        .map(|i| value(2_000_000, 40 + i as u64))
        .collect();
    let before = allocated(image);
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(
            kv.cli_with(&["-x", "SET", &format!("layer{i}")], b).trim(),
            "OK"
        );
    }
    layers_read_back(kv, &blocks);
    let stored = allocated(image);
    assert!(
        stored >= before + VALUES as u64 * 2_000_000,
        "the values took {} bytes of the image",
        stored - before
    );
    for i in 0..VALUES {
        assert_eq!(kv.cli(&["DEL", &format!("layer{i}")]).trim(), "1");
    }
    // Each value's 31 blocks of 64 KiB; the image then holds about what it did before
    // them (checkpoints write the index meanwhile: less than a MiB).
    let freed = VALUES as u64 * 31 * 65536;
    let left = before + (1 << 20);
    let discarded = "dpuflow_kvcache_discarded_bytes_total{service=\"kvcache\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while kv.metric(discarded) < freed || allocated(image) > left {
        assert!(
            Instant::now() < deadline,
            "{} of {freed} bytes discarded; the image takes {} bytes, {before} before the values and {stored} with them",
            kv.metric(discarded),
            allocated(image)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        kv.metric("dpuflow_kvcache_discard_failures_total{service=\"kvcache\"}"),
        0
    );
    let again: Vec<Vec<u8>> = (0..VALUES)
        .map(|i| value(2_000_000, 50 + i as u64))
        .collect();
    for (i, b) in again.iter().enumerate() {
        assert_eq!(
            kv.cli_with(&["-x", "SET", &format!("layer{i}")], b).trim(),
            "OK"
        );
    }
    layers_read_back(kv, &again);
}

#[test]
fn deleted_values_are_discarded_on_a_file_target() {
    let dir = Scratch::new("kv-discard-file");
    let file = dir.path("blocks.img");
    let target = format!("file://{file}");
    // Without checkpoints, and then with them (freed blocks wait for the next).
    for options in ["discard on  checkpoint off", "discard on  checkpoint 1s"] {
        let kv = KvService::start_with(&dir, &target, "32MiB", options);
        deleted_values_are_discarded(&kv, &file);
        assert_eq!(kv.terminate(), 0);
    }
}

/// `BLKDISCARD` on a loop device, which punches the holes in the file behind it.
#[test]
fn deleted_values_are_discarded_on_a_local_block_device() {
    let dir = Scratch::new("kv-discard-block");
    let image = image(&dir, 64);
    let device = LoopDevice::over(&image, 4096);
    let target = format!("nvme://{}", device.0);
    let kv = KvService::start_with(&dir, &target, "32MiB", "discard on  checkpoint 1s");
    deleted_values_are_discarded(&kv, &image);
    assert_eq!(kv.terminate(), 0);
}

#[test]
fn deleted_values_are_trimmed_on_an_nbd_target() {
    let dir = Scratch::new("kv-discard-nbd");
    let image = image(&dir, 64);
    let port = free_port();
    let _nbd = nbd_server_with(&image, port, &["--discard=unmap"]);
    let target = format!("nbd://127.0.0.1:{port}/kv");
    let kv = KvService::start_with(&dir, &target, "32MiB", "discard on  checkpoint 1s");
    deleted_values_are_discarded(&kv, &image);
    assert_eq!(kv.terminate(), 0);
}

/// A target that fails every discard (nbdkit's error filter answering each trim with
/// EIO): each failure is counted, none fails a client's request, and the freed blocks are
/// used again, undiscarded, for values that read back.
#[test]
fn discards_a_target_fails_are_counted_and_the_blocks_used_again() {
    let dir = Scratch::new("kv-discard-refused");
    let image = image(&dir, 64);
    let port = free_port();
    let args = [
        "--filter=error",
        "file",
        &image,
        "error=EIO",
        "error-trim-rate=100%",
    ];
    let _nbd = nbdkit_server(port, &args);
    let target = format!("nbd://127.0.0.1:{port}/kv");
    let kv = KvService::start_with(&dir, &target, "32MiB", "discard on  checkpoint off");
    let failures = "dpuflow_kvcache_discard_failures_total{service=\"kvcache\"}";
    // Four rounds of 12 MB through a 32 MiB store: the later ones take blocks the earlier
    // ones freed.
    for round in 0..4u64 {
        let blocks: Vec<Vec<u8>> = (0..6).map(|i| value(2_000_000, round * 10 + i)).collect();
        for (i, b) in blocks.iter().enumerate() {
            let key = format!("layer{i}");
            assert_eq!(kv.cli_with(&["-x", "SET", &key], b).trim(), "OK");
        }
        layers_read_back(&kv, &blocks);
        for i in 0..blocks.len() {
            assert_eq!(kv.cli(&["DEL", &format!("layer{i}")]).trim(), "1");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while kv.metric(failures) <= round {
            assert!(
                Instant::now() < deadline,
                "no discard failed in round {round}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    assert_eq!(
        kv.metric("dpuflow_kvcache_discarded_bytes_total{service=\"kvcache\"}"),
        0
    );
    assert_eq!(
        kv.metric("dpuflow_kvcache_storage_errors_total{service=\"kvcache\"}"),
        0
    );
    let on_target =
        format!("dpuflow_kvcache_target_errors_total{{service=\"kvcache\",target=\"{target}\"}}");
    assert!(kv.metric(&on_target) >= 4);
    assert_eq!(kv.terminate(), 0);
}

/// Deallocated by Dataset Management on the kernel's target, which discards on its disk,
/// whose emulator punches the holes in the image.
#[test]
fn deleted_values_are_deallocated_on_an_nvme_tcp_target() {
    let dir = Scratch::new("kv-discard-nvme");
    let image = image(&dir, 64);
    let port = free_port();
    let _target = nvmet_target(&image, port);
    let kv = KvService::start_with(
        &dir,
        &format!("nvme-tcp://127.0.0.1:{port}/nqn.2026-11.io.dpuflow:kv"),
        "32MiB",
        &format!("discard on  checkpoint 1s  {EMULATED_TARGET_TIMEOUT}"),
    );
    deleted_values_are_discarded(&kv, &image);
    assert_eq!(kv.terminate(), 0);
}

/// Every one of `blocks` reads back as it was written, as `layer{i}`.
fn layers_read_back(kv: &KvService, blocks: &[Vec<u8>]) {
    for (i, b) in blocks.iter().enumerate() {
        let key = format!("layer{i}");
        assert!(kv.reads_back(&key, b), "{key} came back different");
    }
}

#[test]
fn the_index_survives_a_clean_restart_and_a_crash_with_its_last_checkpoint() {
    let dir = Scratch::new("kv-restart");
    let (_nbd, _, target) = nbd_export(&dir);
    let every_second = "checkpoint 1s";
    let kv = KvService::start_with(&dir, &target, "32MiB", every_second);
    let mut blocks: Vec<Vec<u8>> = (0..5)
        .map(|i| value(100_000 + i * 70_000, i as u64))
        .collect();
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(
            kv.cli_with(&["-x", "SET", &format!("layer{i}")], b).trim(),
            "OK"
        );
    }
    // Deadlines are kept too.
    assert_eq!(kv.cli(&["EXPIREAT", "layer0", "4000000000"]).trim(), "1");
    assert_eq!(kv.terminate(), 0);

    let kv = KvService::start_with(&dir, &target, "32MiB", every_second);
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "5");
    assert_eq!(kv.cli(&["EXPIRETIME", "layer0"]).trim(), "4000000000");
    assert_eq!(kv.cli(&["EXPIRETIME", "layer1"]).trim(), "-1");
    assert_eq!(
        kv.metric("dpuflow_kvcache_restored_keys{service=\"kvcache\"}"),
        5
    );
    layers_read_back(&kv, &blocks);
    // One more, saved by a checkpoint within a second or two; then killed.
    blocks.push(value(300_000, 5));
    assert_eq!(
        kv.cli_with(&["-x", "SET", "layer5"], &blocks[5]).trim(),
        "OK"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while kv.metric("dpuflow_kvcache_checkpoints_total{service=\"kvcache\"}") == 0 {
        assert!(Instant::now() < deadline, "no checkpoint");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(kv.cli(&["INFO", "kvcache"]).contains("checkpoints:1\r\n"));
    // SAVE has nothing new to write, and answers at once.
    assert_eq!(kv.cli(&["SAVE"]).trim(), "OK");
    kv.kill();

    let kv = KvService::start_with(&dir, &target, "32MiB", every_second);
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "6");
    layers_read_back(&kv, &blocks);
    assert_eq!(
        kv.metric("dpuflow_kvcache_corrupt_values_total{service=\"kvcache\"}"),
        0
    );
    kv.kill();
    // Without checkpoints a start takes the saved index (the one the kill left) and
    // marks it taken: after a crash the next start is empty.
    let kv = KvService::start_with(&dir, &target, "32MiB", "checkpoint off");
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "6");
    kv.kill();
    let kv = KvService::start_with(&dir, &target, "32MiB", "checkpoint off");
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "0");
    assert_eq!(
        kv.metric("dpuflow_kvcache_restored_keys{service=\"kvcache\"}"),
        0
    );
    assert_eq!(kv.terminate(), 0);
}

#[test]
fn with_a_password_the_tools_authenticate_and_strangers_do_not_get_in() {
    let dir = Scratch::new("kv-auth");
    let secret = dir.path("kv.secret");
    std::fs::write(&secret, "correct horse\n").expect("secret");
    let file = dir.path("blocks.img");
    let kv = KvService::start_with(
        &dir,
        &format!("file://{file}"),
        "8MiB",
        &format!("password_file \"{secret}\""),
    );
    let port = kv.port.to_string();
    let with = |args: &[&str]| {
        let mut all = vec!["-p", &port, "--no-auth-warning", "-a", "correct horse"];
        all.extend_from_slice(args);
        tool_ok("redis-cli", &all)
    };
    assert_eq!(with(&["SET", "k", "v"]).trim(), "OK");
    assert_eq!(with(&["GET", "k"]).trim(), "v");
    assert!(kv.cli(&["GET", "k"]).contains("NOAUTH"));
    let csv = tool_ok(
        "redis-benchmark",
        &[
            "-p",
            &port,
            "-a",
            "correct horse",
            "-t",
            "set,get",
            "-n",
            "200",
            "-d",
            "4096",
            "--csv",
        ],
    );
    assert!(csv.contains("\"SET\"") && csv.contains("\"GET\""), "{csv}");
    let script = format!(
        r#"
import redis
assert redis.Redis(port={port}, password="correct horse").get("k") == b"v"
try:
    redis.Redis(port={port}, password="wrong").get("k")
    raise SystemExit("a wrong password got in")
except redis.exceptions.RedisError as e:
    # As from Redis itself: WRONGPASS (redis-py 4 raises it as a ResponseError).
    assert "WRONGPASS" in str(e), e
try:
    redis.Redis(port={port}).get("k")
    raise SystemExit("no password got in")
except redis.exceptions.AuthenticationError:
    pass
print("ok")
"#
    );
    redis_py_ok(&script, "passwords");
    assert!(kv.metric("dpuflow_kvcache_auth_failures_total{service=\"kvcache\"}") >= 1);
    assert_eq!(kv.terminate(), 0);
}

/// `dpuflow kv inspect` says what the target's saved index holds — none, one saved at a
/// clean stop, one saved by a checkpoint before a crash — and changes nothing: the next
/// start restores what it said.
#[test]
fn inspecting_a_target_says_what_its_next_start_restores() {
    let dir = Scratch::new("kv-inspect");
    let file = dir.path("blocks.img");
    let target = format!("file://{file}");
    let pipe = dir.path("kv.pipe");
    let inspect = || {
        let out = dpuflow(&["kv", "inspect", &pipe]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let kv = KvService::start_with(&dir, &target, "8MiB", "checkpoint 1s");
    assert!(inspect().contains("no saved index on the target"));
    kv.cli(&["SET", "a", "1"]);
    kv.cli(&["SET", "b", "2", "EX", "1000"]);
    assert_eq!(
        kv.cli_with(&["-x", "SET", "c"], &value(300_000, 1)).trim(),
        "OK"
    );
    assert_eq!(kv.terminate(), 0);
    let said = inspect();
    assert!(said.contains("index saved at a clean stop"), "{said}");
    assert!(
        said.contains("3 keys (1 expiring), values in 7 of "),
        "{said}"
    );

    let kv = KvService::start_with(&dir, &target, "8MiB", "checkpoint 1s");
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "3");
    kv.cli(&["SET", "d", "4"]);
    assert_eq!(kv.cli(&["SAVE"]).trim(), "OK");
    kv.kill();
    let said = inspect();
    assert!(said.contains("index saved by a checkpoint"), "{said}");
    assert!(said.contains("4 keys (1 expiring)"), "{said}");
    let kv = KvService::start_with(&dir, &target, "8MiB", "checkpoint 1s");
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "4");
    assert_eq!(kv.terminate(), 0);
}

/// With the service holding every connection qemu-nbd serves, `dpuflow kv inspect` fails
/// within seconds and says why, instead of waiting for a handshake that does not come.
#[test]
fn inspecting_a_target_that_serves_no_more_clients_says_so() {
    let dir = Scratch::new("kv-inspect-full");
    let image = dir.path("export.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(8 << 20))
        .expect("image");
    let port = free_port();
    let _nbd = nbd_server_with(&image, port, &["--shared=1"]);
    let target = format!("nbd://127.0.0.1:{port}/kv");
    let kv = KvService::start_with(&dir, &target, "8MiB", "connections 1");
    assert_eq!(kv.cli(&["SET", "k", "v"]).trim(), "OK");
    let started = Instant::now();
    let out = dpuflow(&["kv", "inspect", &dir.path("kv.pipe")]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains(&target) && said.contains("did not answer the handshake"),
        "{said}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
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
    assert!(disk[65536..65536 + block.len()] == block[..]);
    assert_eq!(kv.cli(&["DBSIZE"]).trim(), "1");
    assert_eq!(kv.terminate(), 0);
}

/// A service stopped and continued (SIGSTOP and SIGCONT, as a debugger or a frozen cgroup
/// does) keeps its clients: Linux ends a read waiting with a timeout with EINTR when its
/// process resumes (signal(7)), which is no reason to drop a KV-cache connection or a
/// scrape under way.
#[test]
fn a_service_stopped_and_continued_keeps_its_clients() {
    use std::io::Read;
    let dir = Scratch::new("kv-stopped");
    let kv = KvService::start(&dir, &format!("file://{}", dir.path("blocks.img")), "4MiB");
    let mut host = Resp::connect(kv.port);
    assert_eq!(host.call(&["SET", "k", "v"]).trim(), "+OK");
    wait_for_port(kv.metrics.port(), "the metrics endpoint");
    let mut scrape = TcpStream::connect(kv.metrics).expect("connect");
    scrape
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    scrape
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .expect("half a request");
    // The service's threads are waiting in their reads when it stops.
    std::thread::sleep(Duration::from_millis(300));
    let pid = kv.child.0.id().to_string();
    tool_ok("kill", &["-STOP", &pid]);
    std::thread::sleep(Duration::from_millis(300));
    tool_ok("kill", &["-CONT", &pid]);
    std::thread::sleep(Duration::from_millis(300));

    scrape
        .write_all(b"Connection: close\r\n\r\n")
        .expect("the rest of the request");
    let mut answer = String::new();
    scrape.read_to_string(&mut answer).expect("the answer");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(host.call(&["GET", "k"]), "$1\r\nv\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// After many clients have come and gone with large values, the memory their buffers took
/// goes back to the system: the service does not keep the high-water mark of its busiest
/// moment (an allocator keeping each client thread's freed blocks did: 175 MiB here).
#[test]
fn memory_of_large_values_is_returned_once_their_clients_leave() {
    let dir = Scratch::new("kv-memory");
    let kv = KvService::start(
        &dir,
        &format!("file://{}", dir.path("blocks.img")),
        "256MiB",
    );
    let port = kv.port.to_string();
    tool_ok(
        "redis-benchmark",
        &[
            "-p", &port, "-t", "set,get", "-n", "160", "-d", "8000000", "-r", "32", "-c", "16",
            "-q",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while kv.metric("dpuflow_kvcache_clients{service=\"kvcache\"}") > 0 && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let resident = kv.resident_once_below(48 << 20, deadline);
    // 16 clients moved 8 MB values both ways: at their busiest they held over 200 MiB.
    assert!(
        resident < 48 << 20,
        "{} MiB resident with no clients",
        resident >> 20
    );
    assert_eq!(kv.terminate(), 0);
}

/// A deep pipeline of GETs of a large value, and an MGET of it many times over, are
/// answered a share at a time: the service's peak memory follows the share (64 MiB), not
/// the number of values asked for (300 MB each here, all of which it held before).
#[test]
fn many_large_values_asked_for_at_once_are_answered_in_bounded_memory() {
    let dir = Scratch::new("kv-shares");
    let kv = KvService::start(&dir, &format!("file://{}", dir.path("blocks.img")), "64MiB");
    let big = value(2_000_000, 7);
    assert_eq!(kv.cli_with(&["-x", "SET", "big"], &big).trim(), "OK");
    let asked = 150;
    let mut requests = b"*2\r\n$3\r\nGET\r\n$3\r\nbig\r\n".repeat(asked);
    requests.extend_from_slice(format!("*{}\r\n$4\r\nMGET\r\n", asked + 1).as_bytes());
    requests.extend_from_slice(&b"$3\r\nbig\r\n".repeat(asked));
    let mut client = Resp::connect(kv.port);
    client.send_raw(&requests);
    for i in 0..asked {
        assert!(client.bulk() == big, "GET {i} answered other bytes");
    }
    assert_eq!(client.line(), format!("*{asked}"));
    for i in 0..asked {
        assert!(client.bulk() == big, "MGET's value {i} other bytes");
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", kv.child.0.id()))
        .expect("the service's status");
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .expect("VmHWM");
    assert!(
        peak_kib < 150 << 10,
        "the service's peak resident size was {} MiB",
        peak_kib >> 10
    );
    assert_eq!(kv.terminate(), 0);
}

/// Clients that stay connected but quiet do not keep the room their large values took:
/// a connection gives its buffers back once its client has been quiet for a moment.
#[test]
fn quiet_clients_do_not_keep_the_room_of_their_large_values() {
    let dir = Scratch::new("kv-quiet");
    let kv = KvService::start(
        &dir,
        &format!("file://{}", dir.path("blocks.img")),
        "256MiB",
    );
    let value = "v".repeat(8_000_000);
    let mut clients: Vec<Resp> = (0..16).map(|_| Resp::connect(kv.port)).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        let key = format!("k{i}");
        assert_eq!(c.call(&["SET", &key, &value]), "+OK\r\n");
        assert_eq!(
            c.call(&["GET", &key]).len(),
            value.len() + "$8000000\r\n\r\n".len()
        );
    }
    assert_eq!(
        kv.metric("dpuflow_kvcache_clients{service=\"kvcache\"}"),
        16
    );
    let resident = kv.resident_once_below(48 << 20, Instant::now() + Duration::from_secs(10));
    // Each connection read a value and wrote one: 16 MB of buffers each while busy.
    assert!(
        resident < 48 << 20,
        "{} MiB resident, 16 clients quiet",
        resident >> 20
    );
    // And the connections still serve.
    for c in &mut clients {
        assert_eq!(c.call(&["PING"]), "+PONG\r\n");
    }
    assert_eq!(kv.terminate(), 0);
}

/// Started with a soft limit of 256 open files, as a shell or a unit without
/// `LimitNOFILE` may leave it, the service raises it and serves more clients than that.
#[test]
fn more_clients_than_the_soft_file_limit_are_served() {
    let dir = Scratch::new("kv-fds");
    let kv = KvService::spawn(
        &dir,
        free_port(),
        &format!("file://{}", dir.path("blocks.img")),
        "4MiB",
        "",
        Some(256),
    );
    let hard: u64 = tool_ok("sh", &["-c", "ulimit -H -n"])
        .trim()
        .parse()
        .expect("limit");
    assert!(
        hard >= 1024,
        "this test needs a hard limit of at least 1024 files, not {hard}"
    );
    assert_eq!(kv.metric("process_max_fds"), hard);
    let mut clients: Vec<Resp> = (0..400).map(|_| Resp::connect(kv.port)).collect();
    for (i, c) in clients.iter_mut().enumerate() {
        assert_eq!(c.call(&["PING"]), "+PONG\r\n", "client {i}");
    }
    assert_eq!(
        kv.metric("dpuflow_kvcache_clients{service=\"kvcache\"}"),
        400
    );
    drop(clients);
    assert_eq!(kv.terminate(), 0);
}

/// `MONITOR` streams what every connection runs, as redis-server streams it: the same
/// requests to both, the same lines (but for their time and address) in the same order,
/// the administrative commands and those refused for their arguments left out, passwords
/// redacted, arguments escaped; pipelined GETs each shown as sent.
#[test]
fn monitor_shows_requests_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-monitor");
    let watch = |port: u16| {
        let mut w = Resp::connect(port);
        assert_eq!(w.call(&["MONITOR"]), "+OK\r\n");
        w
    };
    let (mut ours_watch, mut theirs_watch) = (watch(kv.port), watch(redis_port));
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    // Our MONITOR starts streaming once its reply is sent; a first request shows it has.
    for (c, w) in [
        (&mut ours, &mut ours_watch),
        (&mut theirs, &mut theirs_watch),
    ] {
        c.call(&["PING", "ready"]);
        assert!(w.reply().ends_with("\"PING\" \"ready\"\r\n"));
    }
    let script: &[&[&str]] = &[
        &["SET", "a", "b"],
        &["get", "a"],
        &["CONFIG", "GET", "maxmemory"],
        &["CLIENT", "SETNAME", "watched"],
        &["CLIENT", "LIST"],
        &["CLIENT", "ID"],
        &["CLIENT", "KILL", "ID", "999999"],
        &["SLOWLOG", "LEN"],
        &["LASTSAVE"],
        &["LATENCY", "LATEST"],
        &["INFO", "keyspace"],
        &["DBSIZE"],
        &["MEMORY", "USAGE", "a"],
        &["COMMAND", "COUNT"],
        &["AUTH", "secret"],
        &["ECHO", "tab\there \"quoted\" \u{1}\u{7f}"],
        &["SCAN", "0"],
        &["SELECT", "0"],
        &["TYPE", "a"],
        &["EXPIRE", "a", "100"],
        &["MGET", "a", "b"],
        &["GET"],
        &["CLIENT", "SETNAME"],
        &["FLUSHALL", "foo"],
        &["SET", "k", "v", "PX", "0"],
        &["GETEX", "a", "foo"],
        &["NOSUCH", "x"],
        &["DEL", "a"],
        // A transaction's requests are shown as they run, at its EXEC.
        &["WATCH", "a"],
        &["MULTI"],
        &["SET", "a", "1"],
        &["GET", "a"],
        &["GET"],
        &["EXEC"],
        &["MULTI"],
        &["SET", "a", "2"],
        &["DISCARD"],
    ];
    for words in script {
        ours.call(words);
        theirs.call(words);
    }
    // Pipelined GETs, which the service otherwise serves as one run; an MGET typed by
    // hand.
    let mut typed = Vec::new();
    for c in [&mut ours, &mut theirs] {
        c.send_raw(b"*2\r\n$3\r\nGET\r\n$2\r\np1\r\n*2\r\n$3\r\nGET\r\n$2\r\np2\r\n");
        c.send_raw(b"*2\r\n$3\r\nGET\r\n$2\r\np3\r\n");
        for _ in 0..3 {
            assert_eq!(c.reply(), "$-1\r\n");
        }
        c.call(&["SET", "t", "typed"]);
        c.send_raw(b"MGET t nope\r\n");
        typed.push(c.reply());
        c.call(&["ECHO", "end"]);
    }
    assert_eq!(typed[0], typed[1]);
    let shown = |w: &mut Resp| {
        let mut lines = Vec::new();
        loop {
            let line = w.reply();
            // `+1700000000.123456 [0 127.0.0.1:5000] "ECHO" "end"`: what follows the address.
            let (_, request) = line.split_once("] ").unwrap_or_else(|| panic!("{line:?}"));
            if request == "\"ECHO\" \"end\"\r\n" {
                return lines;
            }
            lines.push(request.to_owned());
        }
    };
    let (a, b) = (shown(&mut ours_watch), shown(&mut theirs_watch));
    assert_eq!(a, b);
    assert!(
        a.contains(&"\"AUTH\" \"(redacted)\"\r\n".to_owned()),
        "{a:?}"
    );
    assert_eq!(a.iter().filter(|l| l.starts_with("\"GET\" \"p")).count(), 3);
    // A watcher leaves with QUIT; the service stops streaming to it.
    ours_watch.send_raw(b"QUIT\r\n");
    assert_eq!(ours_watch.reply(), "+OK\r\n");
    assert_eq!(ours.call(&["PING"]), "+PONG\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// A host that stops reading in the middle of a large reply (hung, its receive window
/// shut: keepalives never end such a connection) holds its connection only until
/// `CLIENT KILL` chooses it.
#[test]
fn a_client_that_stopped_reading_is_killed() {
    let dir = Scratch::new("kv-kill-stuck");
    let target = format!("file://{}", dir.path("blocks.img"));
    let kv = KvService::start_with(&dir, &target, "128MiB", "");
    let mut admin = Resp::connect(kv.port);
    let value = "v".repeat(48 << 20);
    assert_eq!(admin.call(&["SET", "big", &value]), "+OK\r\n");
    drop(value);
    let mut stuck = Resp::connect(kv.port);
    let stuck_id = stuck.call(&["CLIENT", "ID"]);
    stuck.send_raw(b"GET big\r\n");
    let clients = "dpuflow_kvcache_clients{service=\"kvcache\"}";
    // Its reply fills the sockets' buffers and its thread waits to write the rest.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(kv.metric(clients), 2);
    let id = stuck_id.trim().trim_start_matches(':');
    assert_eq!(admin.call(&["CLIENT", "KILL", "ID", id]), ":1\r\n");
    let mut gone = false;
    for _ in 0..50 {
        if kv.metric(clients) == 1 {
            gone = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(gone, "the killed client's connection is still served");
    assert_eq!(admin.call(&["PING"]), "+PONG\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// Two services, `NAME-a` and `NAME-b`, listed as the nodes of one cluster in that
/// order, each storing on a file of 64 MiB, with the service options `more` makes (given
/// the first's scratch directory).
fn two_nodes(
    name: &str,
    more: impl FnOnce(&Scratch) -> String,
) -> ([u16; 2], [Scratch; 2], Vec<KvService>) {
    let ports = [free_port(), free_port()];
    let nodes: String = ports
        .iter()
        .map(|p| format!("cluster_node 127.0.0.1:{p}\n"))
        .collect();
    let dirs = [
        Scratch::new(&format!("{name}-a")),
        Scratch::new(&format!("{name}-b")),
    ];
    let options = format!("{nodes} {}", more(&dirs[0]));
    let kvs = (dirs.iter().zip(ports))
        .map(|(d, port)| {
            let target = format!("file://{}", d.path("blocks.img"));
            KvService::spawn(d, port, &target, "64MiB", &options, None)
        })
        .collect();
    (ports, dirs, kvs)
}

/// Services listing each other as `cluster_node`s are one Redis Cluster: each serves the
/// keys of its share of the hash slots and sends a client asking for another's there
/// (`MOVED`), and keys of two slots in one request are refused (`CROSSSLOT`), as Redis
/// refuses them; the slots are Redis's (`CLUSTER KEYSLOT` against a redis-server in
/// cluster mode, for 300 keys, hash tags among them), and a cluster of one node answers
/// `CLUSTER SLOTS`, `SHARDS`, `NODES` and `INFO` as that redis-server does, but for its
/// id and its bus. Cluster clients use it as they
/// would a Redis Cluster: `redis-cli -c` follows the redirections, `redis-cli --cluster
/// check` finds every slot covered and the nodes agreeing, redis_exporter exports the
/// cluster's state, and redis-py's
/// `RedisCluster` puts and gets 300 keys, one at a time, pipelined and across slots,
/// each landing on the node that serves it, and its asyncio client 64 chunks as
/// LMCache's `redis-cluster://` connector keeps them. GETs and SETs pipelined over both
/// nodes' keys are answered in order, those of the other node redirected.
#[test]
fn services_listed_as_cluster_nodes_are_one_redis_cluster() {
    let (ports, dirs, kvs) = two_nodes("kv-cluster", |_| String::new());
    // A redis-server in cluster mode, serving every slot itself.
    let (redis_port, bus_port) = (free_port(), free_port());
    let _redis = Running(
        Command::new("redis-server")
            .args(["--port", &redis_port.to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--cluster-enabled",
                "yes",
            ])
            .args(["--cluster-config-file", &dirs[0].path("nodes.conf")])
            .args(["--cluster-announce-ip", "127.0.0.1"])
            // Its bus elsewhere than its port + 10000, which may be taken.
            .args(["--cluster-port", &bus_port.to_string()])
            .args(["--dir", &dirs[0].path("")])
            .stdout(std::fs::File::create(dirs[0].path("redis.log")).expect("log"))
            .spawn()
            .expect("`redis-server` is required (scripts/test installs it)"),
    );
    wait_for_port(redis_port, "redis-server");
    let (mut a, mut b) = (Resp::connect(ports[0]), Resp::connect(ports[1]));
    let mut redis = Resp::connect(redis_port);
    assert_eq!(
        redis.call(&["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]),
        "+OK\r\n"
    );
    // A cluster of one node describes itself as that Redis does, but for its id and its
    // bus (none here); wait for Redis to take its slots.
    let alone_port = free_port();
    let alone_dir = Scratch::new("kv-cluster-alone");
    let target = format!("file://{}", alone_dir.path("blocks.img"));
    let one = format!("cluster_node 127.0.0.1:{alone_port}");
    let alone = KvService::spawn(&alone_dir, alone_port, &target, "4MiB", &one, None);
    let mut solo = Resp::connect(alone_port);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !redis
        .call(&["CLUSTER", "INFO"])
        .contains("cluster_state:ok")
    {
        assert!(
            Instant::now() < deadline,
            "redis-server's cluster never became ok"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let redis_id = redis.call(&["CLUSTER", "MYID"])[5..45].to_owned();
    let solo_id = solo.call(&["CLUSTER", "MYID"])[5..45].to_owned();
    for words in [
        &["CLUSTER", "SLOTS"][..],
        &["CLUSTER", "SHARDS"],
        &["CLUSTER", "NODES"],
        &["CLUSTER", "INFO"],
    ] {
        let theirs = (redis.call(words))
            .replace(&redis_id, &solo_id)
            .replace(
                &format!("{redis_port}@{bus_port}"),
                &format!("{alone_port}@0"),
            )
            .replace(&format!(":{redis_port}\r\n"), &format!(":{alone_port}\r\n"));
        // Text (NODES, INFO) compared without its length, which the bus port changes.
        let body = |r: &str| match r.strip_prefix('$') {
            Some(text) => text.split_once("\r\n").map(|(_, t)| t.to_owned()),
            None => Some(r.to_owned()),
        };
        assert_eq!(body(&solo.call(words)), body(&theirs), "{words:?}");
    }
    // Keys held of a slot, counted and listed, errors included, as that Redis does.
    for r in [&mut solo, &mut redis] {
        for k in ["{t}a", "{t}b", "c"] {
            assert_eq!(r.call(&["SET", k, "1"]), "+OK\r\n");
        }
    }
    let t = redis.call(&["CLUSTER", "KEYSLOT", "{t}"]);
    let t = t.trim_start_matches(':').trim_end();
    let script: &[&[&str]] = &[
        &["CLUSTER", "COUNTKEYSINSLOT", t],
        &["CLUSTER", "GETKEYSINSLOT", t, "0"],
        &["CLUSTER", "COUNTKEYSINSLOT", "abc"],
        &["CLUSTER", "COUNTKEYSINSLOT", "16384"],
        &["CLUSTER", "COUNTKEYSINSLOT", "-1"],
        &["CLUSTER", "GETKEYSINSLOT", "0", "-1"],
        &["CLUSTER", "GETKEYSINSLOT", "x", "1"],
        &["CLUSTER", "GETKEYSINSLOT", "16384", "1"],
        &["CLUSTER", "GETKEYSINSLOT", "0", "abc"],
        // A transaction's keys must share a slot, as each request's must.
        &["MULTI"],
        &["SET", "{t}a", "2"],
        &["GET", "{t}b"],
        &["EXEC"],
        &["MULTI"],
        &["SET", "{t}a", "3"],
        &["SET", "c", "3"],
        &["EXEC"],
        &["MGET", "{t}a", "{t}b"],
        &["GET", "c"],
        &["MULTI"],
        &["MSET", "{t}a", "4", "c", "4"],
        &["EXEC"],
    ];
    let differ = answers_differ(&mut solo, &mut redis, script);
    assert!(differ.is_empty(), "{differ:#?}");
    let mut both = bulks(&solo.call(&["CLUSTER", "GETKEYSINSLOT", t, "10"]));
    both.sort_unstable();
    assert_eq!(both, ["{t}a", "{t}b"]);
    let one = bulks(&solo.call(&["CLUSTER", "GETKEYSINSLOT", t, "1"]));
    assert!(one.len() == 1 && both.contains(&one[0]), "{one:?}");
    assert_eq!(redis.call(&["FLUSHALL"]), "+OK\r\n");
    assert_eq!(alone.terminate(), 0);
    let mut next = numbers(7);
    let keys: Vec<String> = (0..300)
        .map(|i| match i % 3 {
            0 => format!("key:{i}"),
            1 => format!("{{layer{}}}.chunk:{i}", next(8)),
            _ => format!("{}{{}}{{x{i}", "é".repeat(next(4))),
        })
        .collect();
    for k in &keys {
        let slot = a.call(&["CLUSTER", "KEYSLOT", k]);
        assert_eq!(slot, redis.call(&["CLUSTER", "KEYSLOT", k]), "{k}");
        assert_eq!(slot, b.call(&["CLUSTER", "KEYSLOT", k]), "{k}");
    }
    // Redis's reply where a request's keys are of two slots; where a node does not serve
    // the slot, the node that does.
    for words in [
        &["MSET", "a", "1", "b", "2"][..],
        &["MGET", "a", "b"],
        &["DEL", "a", "b"],
        &["EXISTS", "{t}a", "b"],
    ] {
        let crossslot = redis.call(words);
        assert!(crossslot.starts_with("-CROSSSLOT"), "{crossslot}");
        assert_eq!(a.call(words), crossslot, "{words:?}");
    }
    let foo = format!("-MOVED 12182 127.0.0.1:{}\r\n", ports[1]);
    assert_eq!(a.call(&["GET", "foo"]), foo);
    assert_eq!(a.call(&["SET", "foo", "x"]), foo);
    assert_eq!(a.call(&["MEMORY", "USAGE", "foo"]), foo);
    assert_eq!(b.call(&["SET", "foo", "x"]), "+OK\r\n");
    for r in [&mut a, &mut b] {
        assert_eq!(r.call(&["READONLY"]), "+OK\r\n");
        let hello = r.call(&["HELLO", "2"]);
        assert!(hello.contains("$4\r\nmode\r\n$7\r\ncluster\r\n"), "{hello}");
        let server = r.call(&["INFO", "server"]);
        assert!(server.contains("redis_mode:cluster\r\n"), "{server}");
        let info = r.call(&["CLUSTER", "INFO"]);
        assert!(
            info.contains("cluster_state:ok\r\n") && info.contains("cluster_known_nodes:2\r\n"),
            "{info}"
        );
        assert!(r.call(&["INFO", "cluster"]).contains("cluster_enabled:1"));
    }
    // Both nodes list the same two, the one asked marked `myself`.
    let (nodes_a, nodes_b) = (a.call(&["CLUSTER", "NODES"]), b.call(&["CLUSTER", "NODES"]));
    assert_eq!(
        nodes_a.replace("myself,", ""),
        nodes_b.replace("myself,", "")
    );
    assert!(
        nodes_a.contains(&format!(
            ":{}@0 myself,master - 0 0 0 connected 0-8191\n",
            ports[0]
        )),
        "{nodes_a}"
    );
    let id_b = b.call(&["CLUSTER", "MYID"]);
    assert!(nodes_a.contains(&format!("{} 127.0.0.1:{}@0 master", &id_b[5..45], ports[1])));
    // GETs and SETs pipelined over both nodes' keys: answered in order, each of the other
    // node's redirected.
    let mut slot_of = |k: &str| -> u16 {
        let slot = redis.call(&["CLUSTER", "KEYSLOT", k]);
        slot[1..slot.len() - 2].parse().expect("a slot")
    };
    let (here, there): (Vec<&String>, Vec<&String>) = keys.iter().partition(|k| slot_of(k) < 8192);
    let mixed: Vec<&String> = (here.iter().zip(&there))
        .flat_map(|(h, t)| [*h, *t])
        .take(20)
        .collect();
    let mut pipelined = String::new();
    let mut expected = Vec::new();
    for (i, k) in mixed.iter().enumerate() {
        pipelined += &format!(
            "*3\r\n$3\r\nSET\r\n${}\r\n{k}\r\n$1\r\n{}\r\n",
            k.len(),
            i % 10
        );
        expected.push(match here.contains(k) {
            true => "+OK\r\n".to_owned(),
            false => format!("-MOVED {} 127.0.0.1:{}\r\n", slot_of(k), ports[1]),
        });
    }
    for (i, k) in mixed.iter().enumerate() {
        pipelined += &format!("*2\r\n$3\r\nGET\r\n${}\r\n{k}\r\n", k.len());
        expected.push(match here.contains(k) {
            true => format!("$1\r\n{}\r\n", i % 10),
            false => expected[i].clone(),
        });
    }
    a.send_raw(pipelined.as_bytes());
    let replies: Vec<String> = expected.iter().map(|_| a.reply()).collect();
    assert_eq!(replies, expected);
    assert_eq!(a.call(&["FLUSHALL"]), "+OK\r\n");
    assert_eq!(b.call(&["FLUSHALL"]), "+OK\r\n");
    // Counted apart from the requests served: the 4 CROSSSLOT, the 3 MOVED, the 20
    // pipelined to the other node.
    let redirected = "dpuflow_kvcache_redirected_requests_total{service=\"kvcache\"}";
    assert_eq!(kvs[0].metric(redirected), 27);
    assert_eq!(kvs[1].metric(redirected), 0);
    // `redis-cli -c` follows the redirection.
    let cli = |port: u16, words: &[&str]| {
        let port = port.to_string();
        let args: Vec<&str> = ["-c", "-p", &port].iter().chain(words).copied().collect();
        tool_ok("redis-cli", &args).trim().to_owned()
    };
    assert_eq!(cli(ports[0], &["SET", "foo", "bar"]), "OK");
    assert_eq!(cli(ports[0], &["GET", "foo"]), "bar");
    assert_eq!(b.call(&["DBSIZE"]), ":1\r\n");
    // What an operator checks a cluster with: every slot covered, the nodes agreeing.
    let node = format!("127.0.0.1:{}", ports[1]);
    let check = tool_ok("redis-cli", &["--cluster", "check", &node]);
    for ok in [
        "[OK] 1 keys in 2 masters.",
        "[OK] All nodes agree about slots configuration.",
        "[OK] All 16384 slots covered.",
    ] {
        assert!(check.contains(ok), "{check}");
    }
    // redis-py's cluster client, as a cache's connector would drive it.
    let script = format!(
        r#"
import redis
from redis.cluster import RedisCluster, ClusterNode
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {a})])
keys = {keys:?}
for i, k in enumerate(keys):
    assert rc.set(k, bytes([i % 256]) * (i * 97 % 5000 + 1))
for i, k in enumerate(keys):
    assert rc.get(k) == bytes([i % 256]) * (i * 97 % 5000 + 1), k
assert rc.mset_nonatomic({{"x1": "1", "x2": "2", "x3": "3"}})
assert rc.mget_nonatomic(["x1", "x2", "nope", "x3"]) == [b"1", b"2", None, b"3"]
p = rc.pipeline()
for k in keys[:50]:
    p.exists(k)
assert p.execute() == [1] * 50
assert rc.delete(*keys[:10]) == 10
nodes = [redis.Redis(port=p) for p in ({a}, {b})]
sizes = [n.dbsize() for n in nodes]
assert sum(sizes) == len(keys) - 10 + 3 + 1, sizes
assert all(s > 50 for s in sizes), sizes
for n, here in zip(nodes, (range(0, 8192), range(8192, 16384))):
    for k in n.keys("*"):
        assert rc.keyslot(k) in here, k

# As LMCache's redis-cluster:// connector keeps chunks: redis-py's asyncio cluster
# client, a chunk's bytes then its metadata, many at once.
import asyncio
from redis.asyncio.cluster import RedisCluster as AsyncCluster, ClusterNode as AsyncNode
async def chunks():
    c = AsyncCluster(startup_nodes=[AsyncNode("127.0.0.1", {b})])
    names = [f"model@{{i}}@chunk" for i in range(64)]
    async def put(i, n):
        await c.set(n + "kv_bytes", bytes([i]) * 70000)
        await c.set(n + "metadata", str(i).encode())
    await asyncio.gather(*(put(i, n) for i, n in enumerate(names)))
    for i, n in enumerate(names):
        assert await c.exists(n + "metadata") == 1
        assert await c.get(n + "metadata") == str(i).encode()
        assert await c.get(n + "kv_bytes") == bytes([i]) * 70000
    await c.close()
asyncio.run(chunks())
print("ok")
"#,
        a = ports[0],
        b = ports[1],
    );
    redis_py_ok(&script, "RedisCluster over two nodes");
    // What a Redis cluster's dashboards are fed: redis_exporter's cluster metrics.
    let (body, said) = redis_exporter_scrape(&dirs[0], ports[0], &[]);
    for (name, expected) in [
        ("redis_up", 1),
        ("redis_cluster_enabled", 1),
        ("redis_cluster_state", 1),
        ("redis_cluster_slots_assigned", 16384),
        ("redis_cluster_slots_ok", 16384),
        ("redis_cluster_slots_fail", 0),
        ("redis_cluster_known_nodes", 2),
        ("redis_cluster_size", 2),
    ] {
        assert_eq!(metric(&body, name), Some(expected), "{name} in\n{body}");
    }
    assert!(body.contains("redis_mode=\"cluster\""), "{body}");
    assert!(!said.contains("err:"), "{said}");
    for kv in kvs {
        assert_eq!(kv.terminate(), 0);
    }
}

/// A cluster grown by a node keeps its cache: the nodes started with the longer list hand
/// the saved keys of the slots that changed hands to the nodes now serving them (with
/// their deadlines, and not over a value the new node was given meanwhile), trying again
/// a node that is not up yet, over AUTH. And shrunk again: the node taken out, started
/// as leaving, hands all its keys to the nodes that stay. Read back through redis-py's
/// cluster client and checked with `redis-cli --cluster check` each time.
#[test]
fn a_cluster_grown_by_a_node_hands_it_the_keys_of_its_slots() {
    let ports = [free_port(), free_port(), free_port()];
    let dirs = [
        Scratch::new("kv-grow-a"),
        Scratch::new("kv-grow-b"),
        Scratch::new("kv-grow-c"),
    ];
    let secret = dirs[0].path("kv.secret");
    std::fs::write(&secret, "grow it\n").expect("secret");
    let start_as = |i: usize, nodes: usize, more: &str| {
        let list: String = (ports[..nodes].iter())
            .map(|p| format!("cluster_node 127.0.0.1:{p}\n"))
            .collect();
        let target = format!("file://{}", dirs[i].path("blocks.img"));
        let options = format!("{list} password_file \"{secret}\" {more}");
        KvService::spawn(&dirs[i], ports[i], &target, "64MiB", &options, None)
    };
    let start = |i: usize, nodes: usize| start_as(i, nodes, "");
    let (a, b) = (start(0, 2), start(1, 2));
    // 300 keys over the two nodes, a third of them expiring in ten minutes.
    let script = format!(
        r#"
from redis.cluster import RedisCluster, ClusterNode
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {a})], password="grow it")
for i in range(300):
    assert rc.set(f"chunk:{{i}}", bytes([i % 256]) * (i * 131 % 9000 + 1), px=600000 if i % 3 == 0 else None)
assert rc.set("moved-and-renewed", b"old")
print("ok")
"#,
        a = ports[0]
    );
    redis_py_ok(&script, "300 keys over two nodes");
    // The keys that change hands: of slots 5461-8191, from the first node to the second;
    // of 10922-16383, from the second to the third.
    let slots: Vec<u16> = {
        let mut ask = Resp::connect(ports[0]);
        assert_eq!(ask.call(&["AUTH", "grow it"]), "+OK\r\n");
        let keys = (0..300).map(|i| format!("chunk:{i}"));
        (keys.chain(["moved-and-renewed".to_owned()]))
            .map(|k| {
                let slot = ask.call(&["CLUSTER", "KEYSLOT", &k]);
                slot[1..slot.len() - 2].parse().expect("a slot")
            })
            .collect()
    };
    let to_b = slots.iter().filter(|s| (5461..8192).contains(*s)).count() as u64;
    // The renewed key among them: it counts as handed over, the third node having a value.
    let to_c = slots.iter().filter(|s| **s >= 10922).count() as u64;
    assert!(
        slots[300] >= 10922 && to_b > 30 && to_c > 60,
        "{to_b} {to_c}"
    );
    assert_eq!((a.terminate(), b.terminate()), (0, 0));
    // The new node first, given a newer value of a key it now serves; then the first node,
    // whose keys of slots 5461-8191 go to the second, not up yet; then the second.
    let c = start(2, 3);
    assert_eq!(
        c.cli(&[
            "-a",
            "grow it",
            "--no-auth-warning",
            "SET",
            "moved-and-renewed",
            "new"
        ])
        .trim(),
        "OK"
    );
    let a = start(0, 3);
    std::thread::sleep(Duration::from_millis(1500));
    let b = start(1, 3);
    let handed = "dpuflow_kvcache_handed_off_keys_total{service=\"kvcache\"}";
    let deadline = Instant::now() + Duration::from_secs(60);
    // Every key read back through the cluster of the first `n` nodes, each node holding
    // its own slots' keys only (a node taken out, none).
    let read_back = |n: usize| {
        format!(
            r#"
from redis.cluster import RedisCluster, ClusterNode
import redis
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {a})], password="grow it")
for i in range(300):
    assert rc.get(f"chunk:{{i}}") == bytes([i % 256]) * (i * 131 % 9000 + 1), i
    ttl = rc.pttl(f"chunk:{{i}}")
    assert (0 < ttl <= 600000) if i % 3 == 0 else ttl == -1, (i, ttl)
assert rc.get("moved-and-renewed") == b"new"
nodes = [redis.Redis(port=p, password="grow it") for p in ({a}, {b}, {c})]
sizes = [n.dbsize() for n in nodes]
assert sum(sizes[:{n}]) == 301 and sum(sizes[{n}:]) == 0, sizes
for i, node in enumerate(nodes[:{n}]):
    for k in node.keys("*"):
        assert i * 16384 // {n} <= rc.keyslot(k) < (i + 1) * 16384 // {n}, (k, i)
print("ok")
"#,
            a = ports[0],
            b = ports[1],
            c = ports[2],
        )
    };
    let waiting = "dpuflow_kvcache_handoff_keys{service=\"kvcache\"}";
    let none_waiting = |kvs: &[&KvService]| kvs.iter().all(|kv| kv.metric(waiting) == 0);
    while (a.metric(handed), b.metric(handed)) != (to_b, to_c) || !none_waiting(&[&a, &b]) {
        assert!(
            Instant::now() < deadline,
            "handed over {} and {} of {to_b} and {to_c}",
            a.metric(handed),
            b.metric(handed),
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    redis_py_ok(&read_back(3), "the keys after the third node joined");
    assert_eq!(c.metric(handed), 0);
    let checked = |port: u16, masters: usize| {
        let node = format!("127.0.0.1:{port}");
        let check = tool_ok(
            "redis-cli",
            &[
                "-a",
                "grow it",
                "--no-auth-warning",
                "--cluster",
                "check",
                &node,
            ],
        );
        for ok in [
            format!("[OK] 301 keys in {masters} masters."),
            "[OK] All nodes agree about slots configuration.".into(),
            "[OK] All 16384 slots covered.".into(),
        ] {
            assert!(check.contains(&ok), "{check}");
        }
    };
    checked(ports[2], 3);
    for kv in [a, b, c] {
        assert_eq!(kv.terminate(), 0);
    }
    // The third node taken out: the others started with the list of two, it with that
    // list and leaving. Its keys go to the second node, the second's of slots 5461-8191
    // to the first.
    let (a, b) = (start(0, 2), start(1, 2));
    let c = start_as(2, 2, "cluster_leaving on");
    let to_a = slots.iter().filter(|s| (5461..8192).contains(*s)).count() as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while (a.metric(handed), b.metric(handed), c.metric(handed)) != (0, to_a, to_c)
        || !none_waiting(&[&a, &b, &c])
    {
        assert!(
            Instant::now() < deadline,
            "handed over {} and {}",
            b.metric(handed),
            c.metric(handed)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    redis_py_ok(&read_back(2), "the keys after the third node left");
    checked(ports[0], 2);
    for kv in [a, b, c] {
        assert_eq!(kv.terminate(), 0);
    }
}

/// Puts 200 keys `layer:I`, each I's digits `repeat` times, through redis-py (its
/// connection's further `options`, each after a comma) into the node at `port`; how many
/// are of the second half of the slots (8192-16383), which a second node would serve.
fn put_layers(port: u16, options: &str, repeat: usize) -> u64 {
    let script = format!(
        r#"
import redis
from redis.crc import key_slot
r = redis.Redis(host="127.0.0.1", port={port}{options})
for i in range(200):
    assert r.set(f"layer:{{i}}", str(i) * {repeat})
print(sum(key_slot(f"layer:{{i}}".encode()) >= 8192 for i in range(200)))
"#
    );
    let out = tool(PYTHON, &["-c", &script]);
    let second: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("redis-py: {}", String::from_utf8_lossy(&out.stderr)));
    assert!((60..140).contains(&second), "{second}");
    second
}

/// Over mutual TLS, a node hands keys over as a client the other node verifies, and
/// verifies that node's certificate with the CA of `tls_client_ca`: a node alone, grown
/// into a cluster of two, gives the second the keys of its half of the slots (which
/// speaks nothing but TLS and takes only clients with a certificate of that CA).
#[test]
fn over_tls_a_node_hands_keys_to_a_node_it_verifies() {
    let dir = Scratch::new("kv-grow-tls");
    certificates(&dir);
    let p = |f: &str| dir.path(f);
    let ports = [free_port(), free_port()];
    let dirs = [Scratch::new("kv-grow-tls-a"), Scratch::new("kv-grow-tls-b")];
    let start = |i: usize, nodes: usize| {
        let list: String = (ports[..nodes].iter())
            .map(|p| format!("cluster_node 127.0.0.1:{p}\n"))
            .collect();
        let target = format!("file://{}", dirs[i].path("blocks.img"));
        let tls = format!(
            "tls_cert \"{}\" tls_key \"{}\" tls_client_ca \"{}\"",
            p("node.pem"),
            p("node.key"),
            p("ca.pem")
        );
        KvService::spawn(
            &dirs[i],
            ports[i],
            &target,
            "64MiB",
            &format!("{list} {tls}"),
            None,
        )
    };
    let client = format!(
        "ssl=True, ssl_ca_certs='{}', ssl_certfile='{}', ssl_keyfile='{}'",
        p("ca.pem"),
        p("client.pem"),
        p("client.key")
    );
    let alone = start(0, 1);
    let second = put_layers(ports[0], &format!(", {client}"), 500);
    assert_eq!(alone.terminate(), 0);
    let (a, b) = (start(0, 2), start(1, 2));
    let handed = "dpuflow_kvcache_handed_off_keys_total{service=\"kvcache\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.metric(handed) != second {
        assert!(
            Instant::now() < deadline,
            "handed over {}",
            a.metric(handed)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let script = format!(
        r#"
from redis.cluster import RedisCluster, ClusterNode
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {b})], {client})
for i in range(200):
    assert rc.get(f"layer:{{i}}") == (str(i) * 500).encode(), i
sizes = [n.redis_connection.dbsize() for n in rc.get_primaries()]
assert sorted(sizes) == sorted([200 - {second}, {second}]), sizes
print("ok")
"#,
        b = ports[1]
    );
    redis_py_ok(&script, "the keys over TLS after the second node joined");
    assert_eq!((a.terminate(), b.terminate()), (0, 0));
}

/// A cluster grown and shrunk without a restart: the node list of a node's file changed
/// and SIGHUP sent, the node redirects by the new list at once and hands the keys of the
/// slots that changed hands to the node now serving them; every key reads back through
/// redis-py's cluster client, and `redis-cli --cluster check` finds the cluster whole.
/// Shrunk again the same way: the second node's file made `cluster_leaving`, it hands all
/// its keys back.
#[test]
fn a_cluster_regrouped_by_a_reload_hands_over_the_keys_of_the_slots_that_moved() {
    let ports = [free_port(), free_port()];
    let dirs = [Scratch::new("kv-regroup-a"), Scratch::new("kv-regroup-b")];
    let targets: Vec<String> = (dirs.iter())
        .map(|d| format!("file://{}", d.path("blocks.img")))
        .collect();
    let nodes = |n: usize| -> String {
        (ports[..n].iter())
            .map(|p| format!("cluster_node 127.0.0.1:{p}\n"))
            .collect()
    };
    let a = KvService::spawn(&dirs[0], ports[0], &targets[0], "64MiB", &nodes(1), None);
    let second = put_layers(ports[0], "", 300);
    let b = KvService::spawn(&dirs[1], ports[1], &targets[1], "64MiB", &nodes(2), None);
    a.reload(&dirs[0], &targets[0], "64MiB", &nodes(2));
    let handed = "dpuflow_kvcache_handed_off_keys_total{service=\"kvcache\"}";
    let waiting = "dpuflow_kvcache_handoff_keys{service=\"kvcache\"}";
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.metric(handed) != second || a.metric(waiting) != 0 {
        assert!(
            Instant::now() < deadline,
            "handed over {}",
            a.metric(handed)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let read_back = |sizes: &str| {
        format!(
            r#"
from redis.cluster import RedisCluster, ClusterNode
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {b})])
for i in range(200):
    assert rc.get(f"layer:{{i}}") == (str(i) * 300).encode(), i
sizes = sorted(n.redis_connection.dbsize() for n in rc.get_primaries())
assert sizes == {sizes}, sizes
print("ok")
"#,
            b = ports[1]
        )
    };
    let sizes = format!("sorted([200 - {second}, {second}])");
    redis_py_ok(&read_back(&sizes), "the keys after the node list grew");
    let check = tool(
        "redis-cli",
        &["--cluster", "check", &format!("127.0.0.1:{}", ports[1])],
    );
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(said.contains("[OK] All 16384 slots covered."), "{said}");
    assert!(
        said.contains("[OK] All nodes agree about slots configuration."),
        "{said}"
    );
    // Shrunk: the first node serves every slot, then the second leaves.
    a.reload(&dirs[0], &targets[0], "64MiB", &nodes(1));
    b.reload(
        &dirs[1],
        &targets[1],
        "64MiB",
        &format!("{} cluster_leaving on", nodes(1)),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while b.metric(handed) != second {
        assert!(
            Instant::now() < deadline,
            "handed back {}",
            b.metric(handed)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let script = format!(
        r#"
import redis
r = redis.Redis(port={a})
for i in range(200):
    assert r.get(f"layer:{{i}}") == (str(i) * 300).encode(), i
assert r.dbsize() == 200
assert redis.Redis(port={b}).dbsize() == 0
print("ok")
"#,
        a = ports[0],
        b = ports[1]
    );
    redis_py_ok(&script, "the keys after the node list shrank");
    assert_eq!((a.terminate(), b.terminate()), (0, 0));
}

/// `COMMAND INFO` describes each command served as Redis 7.0 describes its own — arity,
/// flags, the keys' places, ACL categories, tips, key specifications — byte for byte
/// against redis-server, in RESP2 and RESP3 (a command's subcommands: those served), so
/// that clients routing by key find a request's keys: redis-py's parser of it, what its
/// cluster client routes by, finds the same keys in both. `COMMAND GETKEYS` and `COMMAND
/// LIST` answer as Redis's do.
#[test]
fn commands_are_described_as_redis_describes_its_own() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-command-info");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let containers = [
        "client", "cluster", "command", "config", "latency", "memory", "slowlog",
    ];
    let served: Vec<String> = bulks(&ours.call(&["COMMAND", "LIST"]));
    assert_eq!(served.len(), 58, "{served:?}");
    for name in &served {
        let (a, b) = (
            ours.call(&["COMMAND", "INFO", name]),
            theirs.call(&["COMMAND", "INFO", name]),
        );
        if !containers.contains(&name.as_str()) {
            assert_eq!(a, without_notes(&b), "{name}");
            continue;
        }
        // Its entry up to its subcommands as Redis's; then each of those served as Redis
        // describes it (one Redis 7.0 lacks, 7.2's `CLIENT SETINFO`, is left out).
        let (head, subs) = split_subcommands(&a);
        assert_eq!(head, split_subcommands(&b).0, "{name}");
        let mut expected = String::new();
        for sub in bulks_at_depth(subs) {
            let info = theirs.call(&["COMMAND", "INFO", &sub]);
            if sub == "client|setinfo" {
                assert_eq!(info, "*1\r\n$-1\r\n");
                let ours_alone = ours.call(&["COMMAND", "INFO", &sub]);
                expected += ours_alone.strip_prefix("*1\r\n").expect("one entry");
                continue;
            }
            assert_eq!(ours.call(&["COMMAND", "INFO", &sub]), info, "{sub}");
            expected += info.strip_prefix("*1\r\n").unwrap();
        }
        assert!(subs.ends_with(&expected), "{name}: {subs:?}");
    }
    let script: &[&[&str]] = &[
        &["COMMAND", "INFO", "get", "nosuch", "MSET"],
        &["COMMAND", "COUNT", "x"],
        &["COMMAND", "GETKEYS", "MSET", "a", "1", "b", "2"],
        &["COMMAND", "GETKEYS", "mset", "a", "1", "b"],
        &["COMMAND", "GETKEYS", "SET", "k", "v", "EX", "10"],
        &["COMMAND", "GETKEYS", "DEL", "a", "b", "c"],
        &["COMMAND", "GETKEYS", "EXPIRE", "k", "10"],
        &["COMMAND", "GETKEYS", "MEMORY", "USAGE", "k"],
        &["COMMAND", "GETKEYS", "GET", "a", "b"],
        &["COMMAND", "GETKEYS", "PING", "x"],
        &["COMMAND", "GETKEYS", "CLIENT", "LIST"],
        &["COMMAND", "GETKEYS", "NOSUCH", "a"],
        &["COMMAND", "GETKEYS", "GET"],
        &["COMMAND", "LIST", "FILTERBY", "MODULE", "x"],
        &["COMMAND", "LIST", "FILTERBY"],
        &["COMMAND", "LIST", "FILTERBY", "NOPE", "x"],
        &["COMMAND", "LIST", "x", "y", "z"],
        // A standalone service, as a standalone Redis.
        &["CLUSTER", "INFO"],
        &["CLUSTER", "KEYSLOT", "foo"],
        &["CLUSTER", "KEYSLOT"],
        &["CLUSTER", "NOSUCH"],
        &["CLUSTER", "HELP"],
        &["CLUSTER"],
        &["READONLY"],
        &["READWRITE", "x"],
        &["ASKING"],
        &["INFO", "cluster"],
    ];
    let differ = answers_differ(&mut ours, &mut theirs, script);
    assert!(differ.is_empty(), "{differ:#?}");
    // Lists: of Redis's commands, those served, in any order.
    for filter in [
        &[][..],
        &["FILTERBY", "PATTERN", "*expire*"],
        &["FILTERBY", "PATTERN", "c?????"],
        &["FILTERBY", "ACLCAT", "string"],
        &["FILTERBY", "ACLCAT", "KEYSPACE"],
        &["FILTERBY", "ACLCAT", "connection"],
        &["FILTERBY", "ACLCAT", "dangerous"],
    ] {
        let words: Vec<&str> = ["COMMAND", "LIST"].iter().chain(filter).copied().collect();
        let mut listed = bulks(&ours.call(&words));
        listed.sort_unstable();
        let mut expected: Vec<String> = bulks(&theirs.call(&words))
            .into_iter()
            .filter(|n| served.contains(n))
            .collect();
        expected.sort_unstable();
        assert!(!listed.is_empty(), "{filter:?}");
        assert_eq!(listed, expected, "{filter:?}");
    }
    for r in [&mut ours, &mut theirs] {
        assert!(r.call(&["HELLO", "3"]).starts_with("%7\r\n"));
    }
    let words = [
        "COMMAND", "INFO", "get", "set", "mget", "mset", "del", "nosuch",
    ];
    let (a, b) = (ours.call(&words), theirs.call(&words));
    assert_eq!(a, without_notes(&b));
    assert!(a.contains("~2\r\n+readonly\r\n+fast\r\n") && a.ends_with("_\r\n"));
    // What redis-py's cluster client finds keys by (and failed on before: `COMMAND`
    // listed nothing, and it raised "MSET command doesn't exist").
    let script = format!(
        r#"
import redis
from redis.commands.parser import CommandsParser
found = []
for port in ({}, {}):
    r = redis.Redis(port=port)
    p = CommandsParser(r)
    found.append([p.get_keys(r, *c) for c in (
        ("MSET", "a", "1", "b", "2"), ("GET", "x"), ("DEL", "a", "b"), ("EXPIRE", "k", "10"),
        ("SET", "k", "v", "PX", "5"), ("MEMORY USAGE", "k"), ("PING",), ("SCAN", "0"))])
assert found[0] == found[1], found
assert found[0][0] == [b"a", b"b"] or found[0][0] == ["a", "b"], found
print("ok")
"#,
        kv.port, redis_port
    );
    redis_py_ok(&script, "keys by COMMAND");
    assert_eq!(kv.terminate(), 0);
}

/// A `COMMAND INFO` reply with Redis's notes on key specifications taken out (the
/// service writes none): each `notes` field and its text, and the one pair fewer in the
/// specification's header.
fn without_notes(reply: &str) -> String {
    let mut out = reply.to_owned();
    while let Some(at) = out.find("$5\r\nnotes\r\n$") {
        let len_at = at + "$5\r\nnotes\r\n$".len();
        let digits = out[len_at..].find("\r\n").expect("a COMMAND INFO reply");
        let len: usize = out[len_at..len_at + digits]
            .parse()
            .expect("a COMMAND INFO reply");
        let end = len_at + digits + 2 + len + 2;
        let header = out[..at]
            .trim_end_matches("\r\n")
            .rfind(['*', '%'])
            .expect("a COMMAND INFO reply");
        let fewer = match &out[header..at] {
            "*8\r\n" => "*6\r\n",
            "%4\r\n" => "%3\r\n",
            h => panic!("notes in {h:?}"),
        };
        out = format!("{}{fewer}{}", &out[..header], &out[end..]);
    }
    out
}

/// A container command's `COMMAND INFO` reply cut where its list of subcommands starts:
/// the entry before it, and the list.
fn split_subcommands(reply: &str) -> (&str, &str) {
    // The reply's array, the entry's, then the first subcommand's entry.
    let entry = reply.find("*10\r\n").expect("a COMMAND INFO reply") + 5;
    let first = entry
        + reply[entry..]
            .find("*10\r\n")
            .expect("a COMMAND INFO reply");
    let list = reply[..first].rfind('*').expect("a COMMAND INFO reply");
    reply.split_at(list)
}

/// The names of the subcommands listed in a [`split_subcommands`] list: the first bulk
/// string of each entry.
fn bulks_at_depth(list: &str) -> Vec<String> {
    list.split("*10\r\n$")
        .skip(1)
        .map(|e| {
            e.split("\r\n")
                .nth(1)
                .expect("a COMMAND INFO reply")
                .to_owned()
        })
        .collect()
}

/// The bulk strings of an array reply of them (none holding CRLF).
fn bulks(reply: &str) -> Vec<String> {
    let lines = reply.split("\r\n").skip(2).step_by(2);
    lines.map(String::from).collect()
}

/// `SLOWLOG`'s errors and settings as a real redis-server gives them; with `slowlog 0ms`
/// every request is kept, newest first, with its arguments, time, address and the
/// connection's name; a run of pipelined GETs is one entry; what carries a password is
/// never kept; with `slowlog off`, nothing is.
#[test]
fn slow_requests_are_logged_as_redis_logs_them() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-slowlog");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let script: &[&[&str]] = &[
        &["SLOWLOG"],
        &["SLOWLOG", "foo"],
        &["SLOWLOG", "LEN", "x"],
        &["SLOWLOG", "RESET", "x"],
        &["SLOWLOG", "GET", "x"],
        &["SLOWLOG", "GET", "-2"],
        &["SLOWLOG", "GET", "1", "2"],
        &["SLOWLOG", "RESET"],
        &["SLOWLOG", "GET", "0"],
        &["SLOWLOG", "HELP", "x"],
        &["CLIENT", "HELP", "x"],
        &["CONFIG", "GET", "slowlog-max-len"],
        &["CONFIG", "GET", "slowlog-log-slower-than"],
    ];
    let differ = answers_differ(&mut ours, &mut theirs, script);
    assert!(differ.is_empty(), "{}", differ.join("\n"));

    let dir = Scratch::new("kv-slowlog-all");
    let target = format!("file://{}", dir.path("blocks.img"));
    let kv = KvService::start_with(&dir, &target, "4MiB", "slowlog 0ms");
    let mut host = Resp::connect(kv.port);
    let addr = host.stream.get_ref().local_addr().unwrap().to_string();
    host.call(&["CLIENT", "SETNAME", "prefill-0"]);
    host.call(&["SET", "layer0", "kv"]);
    host.call(&["SLOWLOG", "RESET"]);
    host.call(&["SET", "layer1", &"v".repeat(300)]);
    host.call(&["AUTH", "secret"]);
    host.send_raw(b"*2\r\n$3\r\nGET\r\n$1\r\na\r\n*2\r\n$3\r\nGET\r\n$1\r\nb\r\n*2\r\n$3\r\nGET\r\n$1\r\nc\r\n");
    for _ in 0..3 {
        assert_eq!(host.reply(), "$-1\r\n");
    }
    let got = host.call(&["SLOWLOG", "GET", "-1"]);
    // Newest first: the pipelined GETs as one, then the SET (its value cut at 128 bytes),
    // then the RESET; not the AUTH. Ids go on from before the RESET (SETNAME 0, SET 1).
    let (run, rest) = got
        .strip_prefix("*3\r\n*6\r\n:4\r\n:")
        .and_then(|g| g.split_once("*6\r\n:3\r\n:"))
        .unwrap_or_else(|| panic!("{got:?}"));
    let tail = format!("\r\n${}\r\n{addr}\r\n$9\r\nprefill-0\r\n", addr.len());
    assert!(
        run.contains("\r\n*3\r\n$3\r\nGET\r\n$1\r\na\r\n$31\r\n... (2 more GET served with it)")
            && run.ends_with(&tail),
        "{run:?}"
    );
    let value = format!("$148\r\n{}... (172 more bytes)\r\n", "v".repeat(128));
    assert!(
        rest.contains(&value) && rest.contains("*6\r\n:2\r\n:") && rest.contains("$5\r\nRESET"),
        "{rest:?}"
    );
    assert!(!got.contains("secret") && !got.contains("AUTH"), "{got:?}");
    assert_eq!(host.call(&["SLOWLOG", "LEN"]), ":4\r\n");
    assert_eq!(kv.terminate(), 0);

    let dir = Scratch::new("kv-slowlog-off");
    let target = format!("file://{}", dir.path("blocks.img"));
    let kv = KvService::start_with(&dir, &target, "4MiB", "slowlog off");
    let mut host = Resp::connect(kv.port);
    assert_eq!(
        host.call(&["CONFIG", "GET", "slowlog-log-slower-than"]),
        "*2\r\n$23\r\nslowlog-log-slower-than\r\n$2\r\n-1\r\n"
    );
    assert_eq!(host.call(&["SLOWLOG", "LEN"]), ":0\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// How many connections not yet accepted the listener on `port` holds (`ss`'s Send-Q
/// of a listening socket).
fn backlog(port: u16) -> u64 {
    let listening = tool_ok("ss", &["-ltnH", &format!("sport = :{port}")]);
    let field = listening.split_whitespace().nth(2);
    field
        .and_then(|f| f.parse().ok())
        .unwrap_or_else(|| panic!("{listening}"))
}

/// With `max_clients 2`, a third connection is told the service is full and closed (as
/// Redis answers past its `maxclients`), counted; once one leaves, the next is served.
#[test]
fn clients_past_max_clients_are_refused() {
    let dir = Scratch::new("kv-max-clients");
    let target = format!("file://{}", dir.path("blocks.img"));
    let kv = KvService::start_with(&dir, &target, "4MiB", "max_clients 2");
    // The connection that found the service listening may not be gone yet.
    let clients = "dpuflow_kvcache_clients{service=\"kvcache\"}";
    for _ in 0..50 {
        if kv.metric(clients) == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut first = Resp::connect(kv.port);
    let mut second = Resp::connect(kv.port);
    for c in [&mut first, &mut second] {
        assert_eq!(c.call(&["PING"]), "+PONG\r\n");
    }
    assert_eq!(
        first.call(&["CONFIG", "GET", "maxclients"]),
        "*2\r\n$10\r\nmaxclients\r\n$1\r\n2\r\n"
    );
    // The listener holds Redis's backlog of connections not yet accepted.
    assert_eq!(backlog(kv.port), 511);
    let mut third = Resp::connect(kv.port);
    let mut said = String::new();
    use std::io::Read;
    third.stream.read_to_string(&mut said).expect("read");
    assert_eq!(said, "-ERR max number of clients reached\r\n");
    assert_eq!(
        kv.metric("dpuflow_kvcache_rejected_clients_total{service=\"kvcache\"}"),
        1
    );
    drop(second);
    // The service notices a connection gone within its poll of the socket (200 ms).
    let mut served = false;
    for _ in 0..50 {
        let mut next = Resp::connect(kv.port);
        next.send_raw(b"PING\r\n");
        if next.reply() == "+PONG\r\n" {
            served = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(served, "no connection served after one left");
    assert_eq!(kv.terminate(), 0);
}

#[test]
fn an_unreachable_target_fails_the_start() {
    let dir = Scratch::new("kv-refused");
    for (target, says) in [
        (
            format!("nbd://127.0.0.1:{}/kv", free_port()),
            "Connection refused",
        ),
        (
            format!(
                "nvme-tcp://127.0.0.1:{}/nqn.2026-11.io.dpuflow:kv",
                free_port()
            ),
            "Connection refused",
        ),
    ] {
        assert_start_fails(&dir, &target, "", says);
    }
}

/// `dpuflow run` of a service of 1 MiB on `target`, with `options`, fails at once, its
/// error saying `says`.
fn assert_start_fails(dir: &Scratch, target: &str, options: &str, says: &str) {
    let pipe = dir.path("kv.pipe");
    std::fs::write(
        &pipe,
        format!(
            "pipeline kv\nport fabric {{ driver pcap }}\n\
             service kvcache {{ listen 127.0.0.1:{}  target \"{target}\"  capacity 1MiB  {options} }}\n\
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

/// A RESP connection sending one command at a time and taking its reply as bytes.
struct Resp {
    stream: std::io::BufReader<TcpStream>,
}

impl Resp {
    fn connect(port: u16) -> Resp {
        let stream = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Resp {
            stream: std::io::BufReader::new(stream),
        }
    }

    /// The reply to `words`, whole (a simple reply, an integer, an error, a bulk string,
    /// an array of them; in RESP3 also a null, a map, a set, a verbatim string).
    fn call<W: AsRef<[u8]>>(&mut self, words: &[W]) -> String {
        self.send(words);
        self.reply()
    }

    /// Sends `words` as one request.
    fn send<W: AsRef<[u8]>>(&mut self, words: &[W]) {
        self.send_raw(&request(words));
    }

    /// `PTTL key`'s milliseconds.
    fn pttl(&mut self, key: &str) -> i64 {
        let reply = self.call(&["PTTL", key]);
        reply[1..].trim().parse().expect("PTTL")
    }

    /// `DUMP key`'s payload.
    fn dump(&mut self, key: &str) -> Vec<u8> {
        self.send(&["DUMP", key]);
        self.bulk()
    }

    /// The keys `KEYS pattern` lists, sorted.
    fn keys(&mut self, pattern: &str) -> Vec<String> {
        let mut keys = bulks(&self.call(&["KEYS", pattern]));
        keys.sort_unstable();
        keys
    }

    /// The next reply, as it came.
    fn reply(&mut self) -> String {
        use std::io::{BufRead, Read};
        let mut line = String::new();
        self.stream.read_line(&mut line).expect("reply");
        let count = |prefix| line.strip_prefix(prefix)?.trim().parse::<usize>().ok();
        if let Some(n) = count('$').or_else(|| count('=')) {
            let mut body = vec![0u8; n + 2];
            self.stream.read_exact(&mut body).expect("bulk");
            line += &String::from_utf8_lossy(&body);
        } else if let Some(n) =
            (count('*').or_else(|| count('~'))).or_else(|| count('%').map(|pairs| pairs * 2))
        {
            for _ in 0..n {
                line += &self.reply();
            }
        }
        line
    }

    /// Sends `bytes` as they are (requests already encoded, any number of them).
    fn send_raw(&mut self, bytes: &[u8]) {
        self.stream.get_mut().write_all(bytes).expect("send");
    }

    /// The next reply line, without its CRLF.
    fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.stream.read_line(&mut line).expect("reply");
        line.trim_end().to_owned()
    }

    /// The next reply, a bulk string: its bytes.
    fn bulk(&mut self) -> Vec<u8> {
        use std::io::Read;
        let head = self.line();
        let n: usize = head
            .strip_prefix('$')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("not a bulk string: {head}"));
        let mut body = vec![0u8; n + 2];
        self.stream.read_exact(&mut body).expect("bulk");
        body.truncate(n);
        body
    }
}

/// redis_exporter, what Redis dashboards are fed by, scrapes the service as it would a
/// Redis: up, its keys, hits and misses, requests and their time by command, bytes in and
/// out, its uptime and role, its connections one by one (`-export-client-list`) and its
/// bound on them, and none of the commands it sends refused.
#[test]
fn redis_exporter_reads_the_service_as_a_redis() {
    let dir = Scratch::new("kv-exporter");
    // The slow log is asserted empty: on a loaded machine (or under an emulator) a command
    // may take the default 10 ms.
    let target = format!("file://{}", dir.path("blocks.img"));
    let kv = KvService::start_with(&dir, &target, "4MiB", "slowlog 10s");
    for i in 0..5 {
        assert_eq!(kv.cli(&["SET", &format!("k{i}"), "v"]).trim(), "OK");
    }
    kv.cli(&["GET", "k0"]);
    kv.cli(&["GET", "missing"]);
    let mut host = Resp::connect(kv.port);
    assert_eq!(host.call(&["CLIENT", "SETNAME", "prefill-0"]), "+OK\r\n");
    let (body, said) = redis_exporter_scrape(&dir, kv.port, &["-export-client-list"]);
    let value = |name: &str| metric(&body, name).unwrap_or_else(|| panic!("no {name} in\n{body}"));
    assert_eq!(value("redis_up"), 1);
    assert_eq!(value("redis_db_keys{db=\"db0\"}"), 5);
    assert_eq!(value("redis_keyspace_hits_total"), 1);
    assert_eq!(value("redis_keyspace_misses_total"), 1);
    assert!(value("redis_uptime_in_seconds") < 600);
    assert_eq!(value("redis_connected_slaves"), 0);
    assert_eq!(value("redis_commands_total{cmd=\"set\"}"), 5);
    assert_eq!(value("redis_commands_total{cmd=\"get\"}"), 2);
    assert!(body.contains("\nredis_commands_duration_seconds_total{cmd=\"set\"} "));
    for bytes in [
        "redis_net_input_bytes_total",
        "redis_net_output_bytes_total",
    ] {
        assert!(value(bytes) > 100, "{bytes}");
    }
    assert_eq!(value("redis_rejected_connections_total"), 0);
    assert_eq!(value("redis_config_maxclients"), 1024);
    assert_eq!(value("redis_slowlog_length"), 0);
    // A connection's read buffer starts at 64 KiB.
    assert_eq!(value("redis_client_recent_max_input_buffer_bytes"), 65536);
    for name in ["prefill-0", "redis_exporter"] {
        assert!(
            body.lines()
                .any(|l| l.starts_with("redis_connected_clients_details{")
                    && l.contains(&format!("name=\"{name}\""))
                    && l.contains("host=\"127.0.0.1\"")),
            "{name} in {body}"
        );
    }
    assert!(
        body.lines()
            .any(|l| l.starts_with("redis_instance_info{") && l.contains("role=\"master\"")),
        "{body}"
    );
    assert!(!said.contains("err:"), "{said}");
    assert_eq!(kv.terminate(), 0);
}

/// redis_exporter started with `options` on the Redis at `port`, scraped once: the
/// metrics, and what it logged (in `dir`) until then.
fn redis_exporter_scrape(dir: &Scratch, port: u16, options: &[&str]) -> (String, String) {
    let listen = free_port();
    let log = dir.path("exporter.log");
    let _exporter = Running(
        Command::new("prometheus-redis-exporter")
            .args(["--redis.addr", &format!("redis://127.0.0.1:{port}")])
            .args(["--web.listen-address", &format!("127.0.0.1:{listen}")])
            .args(options)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("`prometheus-redis-exporter` is required (scripts/test installs it)"),
    );
    wait_for_port(listen, "redis_exporter");
    // Go's server sends large bodies chunked: curl joins them.
    let body = tool_ok(
        "curl",
        &["-sf", &format!("http://127.0.0.1:{listen}/metrics")],
    );
    let said = std::fs::read_to_string(&log).expect("exporter log");
    (body, said)
}

/// A service on a small file target beside a redis-server of its own (keeping nothing on
/// disk), for comparing their answers: the scratch directory, the service, the server and
/// its port.
fn beside_redis(name: &str) -> (Scratch, KvService, Running, u16) {
    let dir = Scratch::new(name);
    let kv = KvService::start(&dir, &format!("file://{}", dir.path("blocks.img")), "4MiB");
    let port = free_port();
    let server = redis_server(&dir, port);
    (dir, kv, server, port)
}

/// A redis-server listening on 127.0.0.1:`port`, keeping nothing on disk.
fn redis_server(dir: &Scratch, port: u16) -> Running {
    // In the scratch directory: a dump.rdb in the working directory would be loaded.
    let server = Running(
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--dir", &dir.path("")])
            .stdout(Stdio::null())
            .spawn()
            .expect("`redis-server` is required (scripts/test installs it)"),
    );
    wait_for_port(port, "redis-server");
    server
}

/// The pipeline file of a KV-cache service listening on 127.0.0.1:`port`, written in
/// `dir`; its path.
fn write_pipe(dir: &Scratch, port: u16, target: &str, capacity: &str, options: &str) -> String {
    let pipe = dir.path("kv.pipe");
    std::fs::write(
        &pipe,
        format!(
            "pipeline kv\nport fabric {{ driver pcap }}\n\
             service kvcache {{ listen 127.0.0.1:{port}  target \"{target}\"  \
             capacity {capacity}  block_size 64KiB  {options} }}\n\
             pipe from_fabric root from fabric {{\n\
                 rule kv {{ match tcp.dst {port}  actions to kvcache }}\n\
                 default {{ actions drop }}\n}}\n"
        ),
    )
    .expect("write pipeline");
    pipe
}

/// A deterministic stream of numbers below the bound asked for (an LCG from `seed`), for
/// requests made at random that a failure can be replayed from.
fn numbers(mut seed: u64) -> impl FnMut(usize) -> usize {
    move |below| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) as usize % below
    }
}

/// Expiry as Redis 7 has it, command by command against a real redis-server: `SET` with
/// `EX`/`PX`/`EXAT`/`PXAT`/`KEEPTTL`, `EXPIRE` and its forms with `NX`/`XX`/`GT`/`LT`,
/// `TTL`, `EXPIRETIME`, `PERSIST`, `GETEX`, `GETDEL`, their errors, deadlines already past,
/// and keys leaving once theirs passes.
#[test]
fn expiry_answers_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-expiry");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let script: &[&[&str]] = &[
        &["SET", "a", "1"],
        &["SET", "a", "2", "PXAT", "1000"],
        &["GET", "a"],
        &["EXISTS", "a"],
        &["SET", "b", "1", "PX", "0"],
        &["SET", "b", "1", "EX", "-1"],
        &["SET", "b", "1", "EX", "abc"],
        &["SET", "b", "1", "EX", "01"],
        &["SET", "b", "1", "EX", "10", "PX", "10"],
        &["SET", "b", "1", "NX", "XX"],
        &["SET", "b", "1", "KEEPTTL", "EX", "5"],
        &["SET", "b", "1", "EX"],
        &["SET", "b", "1", "EXAT", "99999999999999999999"],
        &["SET", "b", "1", "EX", "9223372036854775807"],
        &["SET", "c", "1", "EX", "100"],
        &["TTL", "c"],
        &["SET", "c", "2", "KEEPTTL"],
        &["TTL", "c"],
        &["SET", "c", "3"],
        &["TTL", "c"],
        &["TTL", "nokey"],
        &["PTTL", "nokey"],
        &["EXPIRE", "c", "100", "GT"],
        &["EXPIRE", "c", "100", "LT"],
        &["TTL", "c"],
        &["EXPIRE", "c", "50", "GT"],
        &["EXPIRE", "c", "200", "GT"],
        &["EXPIRE", "c", "10", "NX"],
        &["EXPIRE", "c", "10", "XX"],
        // XX with GT: both must hold (a deadline already passed is not later).
        &["EXPIRE", "c", "-1", "GT", "XX"],
        &["EXPIRE", "c", "20", "XX", "GT"],
        &["EXPIRE", "c", "5", "XX", "LT"],
        &["TTL", "c"],
        &["EXPIRE", "c", "10", "NX", "XX"],
        &["EXPIRE", "c", "10", "GT", "LT"],
        &["EXPIRE", "c", "10", "NX", "GT"],
        &["EXPIRE", "c", "10", "FOO"],
        &["EXPIRE", "c"],
        &["PERSIST", "c"],
        &["PERSIST", "c"],
        &["PERSIST", "nokey"],
        &["EXPIRE", "nokey", "10"],
        &["EXPIRE", "c", "-5"],
        &["EXISTS", "c"],
        &["SET", "d", "1"],
        &["EXPIRE", "d", "abc"],
        &["EXPIRETIME", "d"],
        &["PEXPIRETIME", "nokey"],
        &["PEXPIREAT", "d", "99999999999999"],
        &["EXPIRETIME", "d"],
        &["PEXPIRETIME", "d"],
        &["EXPIRE", "d", "9999999999999999"],
        &["PEXPIRE", "d", "9223372036854775807"],
        &["EXPIREAT", "d", "1"],
        &["EXISTS", "d"],
        &["SET", "e", "1", "EXAT", "99999999999"],
        &["EXPIRETIME", "e"],
        &["SET", "f", "1", "NX", "PXAT", "1000"],
        &["EXISTS", "f"],
        &["SET", "g", "1"],
        &["SET", "g", "2", "XX", "PXAT", "1000"],
        &["EXISTS", "g"],
        &["SET", "h", "1", "XX", "PXAT", "1000"],
        &["MSET", "m", "1", "n", "2"],
        &["EXPIRE", "m", "100"],
        &["MSET", "m", "3"],
        &["TTL", "m"],
        &["SET", "sg", "1"],
        &["SET", "sg", "2", "GET"],
        &["SET", "sgnew", "1", "GET"],
        &["SET", "sg", "3", "NX", "GET"],
        &["GET", "sg"],
        &["SET", "sgx", "9", "XX", "GET"],
        &["EXISTS", "sgx"],
        &["SET", "sg", "4", "GET", "GET"],
        &["SET", "sg", "5", "GET", "EX", "100"],
        &["TTL", "sg"],
        &["SET", "sg", "6", "PX", "0", "GET"],
        &["SET", "sg", "7", "GET", "PXAT", "1000"],
        &["EXISTS", "sg"],
        &["SET", "gd", "v"],
        &["GETDEL", "gd"],
        &["GETDEL", "gd"],
        &["EXISTS", "gd"],
        &["GETDEL", "gd", "x"],
        &["SET", "ge", "v"],
        &["GETEX", "ge", "EX", "100"],
        &["TTL", "ge"],
        &["GETEX", "ge", "PERSIST"],
        &["TTL", "ge"],
        &["GETEX", "ge"],
        &["GETEX", "ge", "PX", "0"],
        &["GETEX", "ge", "EX", "1", "PX", "1"],
        &["GETEX", "ge", "KEEPTTL"],
        &["GETEX", "ge", "EX", "x"],
        &["GETEX", "nokey", "EX", "10"],
        &["GETEX", "ge", "PXAT", "1000"],
        &["EXISTS", "ge"],
        &["GETEX"],
        &["SET", "s", "v", "PX", "200"],
        &["SET", "t", "v", "EX", "100"],
    ];
    for words in script {
        let (a, b) = (ours.call(words), theirs.call(words));
        assert_eq!(a, b, "{words:?}");
    }
    // What is left runs on the clock: milliseconds agree to within the round trips.
    let pttl = |r: &mut Resp| -> i64 {
        let reply = r.call(&["PTTL", "t"]);
        reply
            .trim()
            .trim_start_matches(':')
            .parse()
            .expect("an integer")
    };
    let (a, b) = (pttl(&mut ours), pttl(&mut theirs));
    assert!((a - b).abs() < 1000 && a > 98_000, "PTTL {a} and {b}");
    std::thread::sleep(Duration::from_millis(500));
    for words in [&["GET", "s"][..], &["TTL", "s"], &["EXISTS", "s", "t"]] {
        assert_eq!(ours.call(words), theirs.call(words), "{words:?}");
    }
    assert!(kv.metric("dpuflow_kvcache_expired_keys_total{service=\"kvcache\"}") >= 1);
    assert_eq!(kv.terminate(), 0);
}

/// The requests of `script` whose replies from the service (`ours`) and from Redis
/// (`theirs`) differ, with both replies.
fn answers_differ(ours: &mut Resp, theirs: &mut Resp, script: &[&[&str]]) -> Vec<String> {
    let mut differ = Vec::new();
    for words in script {
        let (a, b) = (ours.call(words), theirs.call(words));
        if a != b {
            differ.push(format!("{words:?}: {a:?}, Redis {b:?}"));
        }
    }
    differ
}

/// A connection that asks for RESP3 with `HELLO 3` gets its replies in it as Redis 7
/// writes them (nulls, maps, verbatim text), byte for byte against a real redis-server,
/// until `HELLO 2` takes it back.
#[test]
fn in_resp3_the_commands_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-resp3");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let hello = ours.call(&["HELLO", "3"]);
    assert!(
        hello.starts_with("%7\r\n$6\r\nserver\r\n$7\r\ndpuflow\r\n")
            && hello.contains("$5\r\nproto\r\n:3\r\n$2\r\nid\r\n:"),
        "{hello:?}"
    );
    assert!(theirs.call(&["HELLO", "3"]).starts_with("%7\r\n"));
    let script: &[&[&str]] = &[
        &["GET", "nope"],
        &["SET", "a", "1"],
        &["SET", "a", "2", "NX"],
        &["SET", "b", "1", "NX", "GET"],
        &["MGET", "a", "nope", "b"],
        &["INFO", "keyspace"],
        &["GETDEL", "nope"],
        &["GETEX", "nope"],
        &["GETSET", "nope2", "x"],
        &["SETNX", "a", "1"],
        &["CLIENT", "GETNAME"],
        &["MEMORY", "USAGE", "nope"],
        &["CONFIG", "GET", "appendonly"],
        &["CONFIG", "GET", "nosuch"],
        &["LATENCY", "LATEST"],
        &["SCAN", "0", "MATCH", "zz*"],
        &["TTL", "a"],
        &["EXISTS", "a", "nope"],
        &["DEL", "a", "b", "nope2"],
        &["HELLO", "4"],
        &["HELLO", "x"],
        &["GET", "nope"],
    ];
    let mut differ = answers_differ(&mut ours, &mut theirs, script);
    // Back to RESP2: the same requests answer as they did before HELLO 3.
    let hello = ours.call(&["HELLO", "2"]);
    assert!(hello.starts_with("*14\r\n"), "{hello:?}");
    assert!(theirs.call(&["HELLO", "2"]).starts_with("*14\r\n"));
    differ.extend(answers_differ(&mut ours, &mut theirs, script));
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert_eq!(ours.call(&["GET", "nope"]), "$-1\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// `CLIENT LIST`, `INFO`, `ID`, `SETNAME`/`GETNAME` and `KILL`: their errors byte for
/// byte against a real redis-server, and what they do on connections of the service's
/// own: every connection listed with its address, name and last command, and the ones
/// `CLIENT KILL` chooses closed.
#[test]
fn clients_are_listed_named_and_killed_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-clients");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let script: &[&[&str]] = &[
        &["CLIENT", "LIST", "TYPE", "foo"],
        &["CLIENT", "LIST", "TYPE", "pubsub"],
        &["CLIENT", "LIST", "TYPE", "replica"],
        &["CLIENT", "LIST", "TYPE"],
        &["CLIENT", "LIST", "ID", "x"],
        &["CLIENT", "LIST", "ID", "0"],
        &["CLIENT", "LIST", "ID", "999999", "y"],
        &["CLIENT", "LIST", "ID"],
        &["CLIENT", "LIST", "ID", "999999"],
        &["CLIENT", "LIST", "foo"],
        &["CLIENT", "ID", "x"],
        &["CLIENT", "INFO", "x"],
        &["CLIENT", "GETNAME"],
        &["CLIENT", "SETNAME", "a b"],
        &["CLIENT", "SETNAME", "a\nb"],
        &["CLIENT", "SETNAME", "prefill-7"],
        &["CLIENT", "GETNAME"],
        &["CLIENT", "SETNAME", ""],
        &["CLIENT", "GETNAME"],
        &["CLIENT", "SETNAME"],
        &["CLIENT", "KILL"],
        &["CLIENT", "KILL", "192.0.2.1:5"],
        &["CLIENT", "KILL", "ID", "0"],
        &["CLIENT", "KILL", "ID", "x"],
        &["CLIENT", "KILL", "ID", "999999"],
        &["CLIENT", "KILL", "ID", "x", "TYPE"],
        &["CLIENT", "KILL", "ID", "1", "TYPE"],
        &["CLIENT", "KILL", "TYPE", "foo"],
        &["CLIENT", "KILL", "TYPE", "master"],
        &["CLIENT", "KILL", "USER", "bob"],
        &["CLIENT", "KILL", "USER", "default", "ADDR", "192.0.2.1:5"],
        &["CLIENT", "KILL", "SKIPME", "maybe"],
        &["CLIENT", "KILL", "MAXAGE", "1"],
        &["CLIENT", "KILL", "LADDR", "192.0.2.1:5"],
        &["HELLO", "3", "SETNAME", "a b"],
        // (Redis 7.0 names the connection before it finds the syntax error; 7.2 and
        // the service do not.)
        &["HELLO", "3", "SETNAME", "x", "AUTH"],
    ];
    let differ = answers_differ(&mut ours, &mut theirs, script);
    assert!(differ.is_empty(), "{}", differ.join("\n"));

    // Two connections: each listed, by the address it has on its side.
    let id = |r: &mut Resp| -> u64 {
        let reply = r.call(&["CLIENT", "ID"]);
        reply.trim().trim_start_matches(':').parse().expect("an id")
    };
    let mut decode = Resp::connect(kv.port);
    let decode_addr = decode.stream.get_ref().local_addr().unwrap().to_string();
    assert_eq!(decode.call(&["CLIENT", "SETNAME", "decode-3"]), "+OK\r\n");
    assert_eq!(
        decode.call(&["CLIENT", "SETINFO", "LIB-NAME", "redis-py"]),
        "+OK\r\n"
    );
    assert_eq!(
        decode.call(&["CLIENT", "SETINFO", "lib-ver", "5 0"]),
        "-ERR lib-ver cannot contain spaces, newlines or special characters.\r\n"
    );
    assert_eq!(
        decode.call(&["CLIENT", "SETINFO", "color", "red"]),
        "-ERR Unrecognized option 'color'\r\n"
    );
    let (me, them) = (id(&mut ours), id(&mut decode));
    decode.call(&["SET", "layer0", "kv"]);
    assert!(me < them, "ids grow: {me}, {them}");
    let list = ours.call(&["CLIENT", "LIST"]);
    let lines: Vec<&str> = list.lines().skip(1).filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.len(), 2, "{list}");
    let theirs_line = lines
        .iter()
        .find(|l| l.starts_with(&format!("id={them} ")))
        .expect("the second connection listed");
    for field in [
        format!(" addr={decode_addr} "),
        format!(" laddr=127.0.0.1:{} ", kv.port),
        " name=decode-3 ".into(),
        " events=r cmd=set user=default redir=-1 resp=2 lib-name=redis-py lib-ver=".into(),
    ] {
        assert!(theirs_line.contains(&field), "{field} in {theirs_line}");
    }
    let info = ours.call(&["CLIENT", "INFO"]);
    assert!(
        info.contains(&format!("id={me} ")) && info.contains(" cmd=client|info "),
        "{info}"
    );
    assert_eq!(
        ours.call(&["CLIENT", "LIST", "ID", &them.to_string()])
            .lines()
            .nth(1),
        Some(*theirs_line)
    );
    let info = ours.call(&["INFO", "clients"]);
    assert!(
        info.contains("connected_clients:2\r\nmaxclients:1024\r\n"),
        "{info}"
    );
    // Room for all of them to connect at once.
    assert_eq!(backlog(kv.port), 1024);

    // Killed by id: its connection is closed, the others go on.
    assert_eq!(
        ours.call(&["CLIENT", "KILL", "ID", &them.to_string()]),
        ":1\r\n"
    );
    let mut rest = Vec::new();
    use std::io::Read;
    let closed = decode.stream.read_to_end(&mut rest);
    assert!(matches!(closed, Ok(0)), "{closed:?} {rest:?}");
    // By address, the old form: OK, then no such client.
    let mut third = Resp::connect(kv.port);
    // Served, so listed (a connection not yet accepted is not).
    assert_eq!(third.call(&["PING"]), "+PONG\r\n");
    let third_addr = third.stream.get_ref().local_addr().unwrap().to_string();
    assert_eq!(ours.call(&["CLIENT", "KILL", &third_addr]), "+OK\r\n");
    assert!(matches!(third.stream.read_to_end(&mut rest), Ok(0)));
    assert_eq!(
        ours.call(&["CLIENT", "KILL", &third_addr]),
        "-ERR No such client\r\n"
    );
    // A connection is skipped by its own filter unless it says SKIPME no; then it gets
    // the reply and is closed.
    let laddr = format!("127.0.0.1:{}", kv.port);
    assert_eq!(ours.call(&["CLIENT", "KILL", "LADDR", &laddr]), ":0\r\n");
    assert_eq!(
        ours.call(&["CLIENT", "KILL", "LADDR", &laddr, "SKIPME", "no"]),
        ":1\r\n"
    );
    assert!(matches!(ours.stream.read_to_end(&mut rest), Ok(0)));
    assert_eq!(kv.terminate(), 0);
}

/// The commands besides expiry, their argument errors included, against a real
/// redis-server: what a client library or redis-cli sends answers as Redis 7 answers it.
#[test]
fn commands_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-commands");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let script: &[&[&str]] = &[
        &["PING"],
        &["PING", "hello"],
        &["PING", "a", "b"],
        &["ECHO", "hello"],
        &["ECHO"],
        &["ECHO", "a", "b"],
        &["SELECT", "0"],
        &["SELECT", "16"],
        &["SELECT"],
        &["SET", "a"],
        &["SET", "a", "1", "2"],
        &["SET", "a", "1", "FOO"],
        &["GET"],
        &["GET", "a", "b"],
        &["GET", "missing"],
        &["STRLEN", "missing"],
        &["STRLEN"],
        &["MSET"],
        &["MSET", "a"],
        &["MSET", "a", "1", "b"],
        &["MSET", "a", "1", "b", "22"],
        &["MGET"],
        &["MGET", "a", "missing", "b"],
        &["STRLEN", "b"],
        &["TYPE", "b"],
        &["TYPE", "missing"],
        &["TYPE"],
        &["TYPE", "b", "x"],
        &["KEYS", "a", "b"],
        &["TTL", "b", "x"],
        &["PERSIST", "b", "x"],
        &["STRLEN", "b", "x"],
        &["SELECT", "0", "x"],
        &["SCAN", "0", "COUNT"],
        &["SCAN", "0", "MATCH", "*", "COUNT", "5", "TYPE"],
        // The older forms of SET.
        &["SETEX", "t", "100", "v"],
        &["GET", "t"],
        &["SETEX", "t", "0", "v"],
        &["SETEX", "t", "-5", "v"],
        &["SETEX", "t", "x", "v"],
        &["SETEX", "t", "9223372036854775807", "v"],
        &["SETEX", "t", "100"],
        &["PSETEX", "t", "100000", "w"],
        &["PSETEX", "t", "0", "w"],
        &["PSETEX", "t", "1", "w", "x"],
        &["SETNX", "t", "1"],
        &["SETNX", "fresh", "1"],
        &["SETNX", "fresh"],
        &["GETSET", "t", "2"],
        // GETSET, like SET, leaves no deadline.
        &["PERSIST", "t"],
        &["GETSET", "missing-too", "x"],
        &["GETSET", "t"],
        &["MGET", "t", "fresh", "missing-too"],
        // The store is empty again for the SCAN cursors below.
        &["DEL", "t", "fresh", "missing-too"],
        &["EXISTS"],
        &["EXISTS", "a", "a", "missing", "b"],
        &["DEL"],
        &["DEL", "a", "missing"],
        &["UNLINK", "b", "b"],
        &["DBSIZE"],
        &["DBSIZE", "x"],
        // Cursors are the server's own: a walk from one matches Redis's on an empty store.
        &["SCAN", "-1"],
        &["SET", "only", "1"],
        &["KEYS", "on*"],
        &["KEYS"],
        &["SCAN"],
        &["SCAN", "abc"],
        &["SCAN", "0", "COUNT", "0"],
        &["SCAN", "0", "COUNT", "x"],
        &["SCAN", "0", "FOO", "1"],
        &["SCAN", "0", "MATCH"],
        &["SCAN", "0", "TYPE", "hash"],
        &["CLIENT", "SETNAME", "me"],
        &["CLIENT", "FOO"],
        &["CLIENT"],
        &["CLIENT", "GETNAME", "x"],
        &["CLIENT", "SETNAME"],
        &["COMMAND", "FOO"],
        &["COMMAND", "COUNT", "x"],
        &["MEMORY"],
        &["MEMORY", "FOO"],
        &["MEMORY", "USAGE"],
        &["LATENCY", "LATEST"],
        &["LATENCY", "LATEST", "x"],
        &["LATENCY", "HISTORY", "command"],
        &["LATENCY", "HISTORY"],
        &["LATENCY", "RESET"],
        &["LATENCY", "RESET", "command", "fork"],
        &["LATENCY", "FOO"],
        &["LATENCY"],
        &["MEMORY", "USAGE", "missing"],
        &["MEMORY", "USAGE", "missing", "SAMPLES", "5"],
        &["MEMORY", "USAGE", "missing", "FOO"],
        &["MEMORY", "USAGE", "missing", "SAMPLES", "x"],
        &["CONFIG"],
        &["CONFIG", "FOO"],
        &["CONFIG", "GET"],
        &["CONFIG", "SET", "save"],
        &["CONFIG", "GET", "nosuchsetting"],
        &["INFO", "nosuchsection"],
        &["AUTH"],
        &["AUTH", "x"],
        &["AUTH", "someone", "x"],
        &["AUTH", "default", "x"],
        &["AUTH", "a", "b", "c"],
        &["HELLO", "4"],
        &["HELLO", "02"],
        &["HELLO", "x"],
        &["HELLO", "2", "FOO"],
        &["HELLO", "2", "AUTH", "someone", "x"],
        &["FLUSHALL", "FOO"],
        &["FLUSHALL", "ASYNC", "SYNC"],
        &["DBSIZE"],
        &["FLUSHDB", "sync"],
        &["SCAN", "18446744073709551616"],
        &["SCAN", "+0", "COUNT", "01"],
        &["FLUSHALL"],
        &["DBSIZE"],
        &["NOSUCHCOMMAND", "x", "y"],
        &["nosuch", &"z".repeat(100), &"y".repeat(100), "w"],
        &["QUIT"],
    ];
    let differ: Vec<String> = script
        .iter()
        .filter_map(|words| {
            let (a, b) = (ours.call(words), theirs.call(words));
            (a != b).then(|| format!("{words:?}: {a:?}, Redis {b:?}"))
        })
        .collect();
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert_eq!(kv.terminate(), 0);
}

/// Transactions as Redis 7 answers them: `MULTI`, requests queued, `EXEC` with their
/// replies in one array (a request failing as it runs fails alone), `DISCARD`; a request
/// refused as it is queued (unknown, the wrong number of arguments, not allowed in a
/// transaction) fails the `EXEC`; nesting and `EXEC`/`DISCARD` without `MULTI`; keys
/// watched, changed by a write or a new deadline (or not), in RESP2 and RESP3.
#[test]
fn transactions_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-multi");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let script: &[&[&str]] = &[
        &["EXEC"],
        &["DISCARD"],
        &["MULTI", "x"],
        &["MULTI"],
        &["MULTI"],
        &["SET", "a", "1"],
        &["GET"],
        &["EXEC"],
        &["GET", "a"],
        &["MULTI"],
        &["SET", "a", "1"],
        &["SET", "b", "2", "EX", "100"],
        &["GET", "a"],
        &["MGET", "a", "b", "c"],
        &["TTL", "b"],
        &["SET", "c", "1", "FOO"],
        &["SETEX", "c", "x", "1"],
        &["DEL", "b"],
        &["EXISTS", "a", "b", "c"],
        &["PING"],
        &["ECHO", "hi"],
        &["EXEC", "x"],
        &["EXEC"],
        &["MULTI"],
        &["NOSUCH", "x"],
        &["SET", "a", "2"],
        &["EXEC"],
        &["GET", "a"],
        &["MULTI"],
        &["SAVE"],
        &["DISCARD"],
        &["MULTI"],
        &["EXEC"],
        &["MULTI"],
        &["SET", "a", "3"],
        &["DISCARD"],
        &["GET", "a"],
        &["MULTI"],
        &["MONITOR"],
        &["GETDEL", "a"],
        &["EXEC"],
        &["MULTI"],
        &["FLUSHALL"],
        &["DBSIZE"],
        &["EXEC"],
        // Runs of SETs and GETs (served together).
        &["MULTI"],
        &["SET", "x", "1"],
        &["SET", "y", "2"],
        &["SET", "x", "3"],
        &["GET", "x"],
        &["GET", "missing"],
        &["GET", "y"],
        &["SET", "z", "4"],
        &["GET", "z"],
        &["EXEC"],
        // Keys watched: the EXEC runs only if none changed since.
        &["WATCH"],
        &["WATCH", "a"],
        &["SET", "a", "1"],
        &["MULTI"],
        &["GET", "a"],
        &["EXEC"],
        &["WATCH", "a", "a", "missing"],
        &["MULTI"],
        &["SET", "a", "2"],
        &["EXEC"],
        &["WATCH", "a"],
        &["GET", "a"],
        &["MULTI"],
        &["WATCH", "b"],
        &["GET", "a"],
        &["EXEC"],
        &["WATCH", "a"],
        &["SET", "a", "2"],
        &["MULTI"],
        &["PING"],
        &["EXEC"],
        &["WATCH", "a"],
        &["EXPIRE", "a", "100"],
        &["MULTI"],
        &["PING"],
        &["EXEC"],
        &["WATCH", "a"],
        &["UNWATCH"],
        &["DEL", "a"],
        &["MULTI"],
        &["GET", "a"],
        &["EXEC"],
        &["UNWATCH", "x"],
        &["WATCH", "a"],
        &["DISCARD"],
        &["SET", "a", "3"],
        &["MULTI"],
        &["PING"],
        &["EXEC"],
        &["WATCH", "a"],
        &["SET", "a", "4"],
        &["MULTI"],
        &["NOSUCH"],
        &["EXEC"],
        &["MULTI"],
        &["PING"],
        &["EXEC"],
        &["WATCH", "a"],
        &["MULTI"],
        &["UNWATCH"],
        &["DISCARD"],
        &["SET", "a", "5"],
        &["MULTI"],
        &["PING"],
        &["EXEC"],
    ];
    let mut differ = answers_differ(&mut ours, &mut theirs, script);
    // RESP3: a transaction a watched key failed answers a null.
    ours.call(&["HELLO", "3"]);
    theirs.call(&["HELLO", "3"]);
    let script: &[&[&str]] = &[
        &["WATCH", "a"],
        &["SET", "a", "6"],
        &["MULTI"],
        &["PING"],
        &["EXEC"],
        &["MULTI"],
        &["GET", "a"],
        &["EXEC"],
    ];
    differ.extend(answers_differ(&mut ours, &mut theirs, script));
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert_eq!(kv.terminate(), 0);
}

/// A transaction's requests meet no other client's: writers set two keys to the same
/// value in transactions, over and over, while readers read both in transactions and
/// must never see them differ; redis-py's default pipeline (a transaction) stores and
/// reads large values; and clients raising one count with redis-py's `transaction()`
/// (`WATCH`, read, `MULTI`, write, `EXEC`, again if the key changed) lose no step.
#[test]
fn a_transaction_is_served_whole_between_other_clients_requests() {
    let dir = Scratch::new("kv-isolation");
    let kv = KvService::start(&dir, &format!("file://{}", dir.path("blocks.img")), "64MiB");
    let script = format!(
        r#"
import threading, redis
port = {port}
r = redis.Redis(port=port)
p = r.pipeline()
for i in range(20):
    p.set(f"layer:{{i}}", bytes([i]) * 200000)
assert p.execute() == [True] * 20
p = r.pipeline()
for i in range(20):
    p.get(f"layer:{{i}}")
assert p.execute() == [bytes([i]) * 200000 for i in range(20)]

failures = []
def write(n):
    c = redis.Redis(port=port)
    for i in range(400):
        p = c.pipeline()
        v = f"{{n}}-{{i}}".encode() * (1 + i % 50)
        p.set("left", v)
        p.set("right", v)
        p.execute()
def read():
    c = redis.Redis(port=port)
    for _ in range(400):
        p = c.pipeline()
        p.get("left")
        p.get("right")
        left, right = p.execute()
        if left != right:
            failures.append((left, right))
threads = [threading.Thread(target=write, args=(n,)) for n in range(3)]
threads += [threading.Thread(target=read) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not failures, failures[:3]

# Read-modify-write with WATCH, as redis-py's transaction() runs it: a count raised by
# several clients at once loses no step (a step whose key changed is run again).
r.set("count", b"0")
def raise_count():
    c = redis.Redis(port=port)
    def step(p):
        n = int(p.get("count"))
        p.multi()
        p.set("count", str(n + 1))
    for _ in range(100):
        c.transaction(step, "count")
threads = [threading.Thread(target=raise_count) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert r.get("count") == b"400", r.get("count")
print("ok")
"#,
        port = kv.port
    );
    redis_py_ok(&script, "transactions against each other");
    assert_eq!(kv.terminate(), 0);
}

/// `DUMP` and `RESTORE` as Redis 7 answers them, with payloads redis-server made: the
/// options, their errors and the order Redis checks them in, deadlines relative and
/// absolute, a deadline already past, a key already there; a payload of a type not held
/// (a list) is refused.
#[test]
fn dump_and_restore_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-restore");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    assert_eq!(theirs.call(&["SET", "text", "hello"]), "+OK\r\n");
    assert_eq!(theirs.call(&["RPUSH", "list", "a", "b"]), ":2\r\n");
    let text = theirs.dump("text");
    let list = theirs.dump("list");
    theirs.call(&["DEL", "text", "list"]);
    let mut broken = text.clone();
    broken[3] ^= 1;
    let past = "1000000000000";
    let later = (std::time::SystemTime::now() + Duration::from_secs(3600))
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis()
        .to_string();
    let t: &[u8] = &text;
    // A port nothing listens on.
    let closed = free_port().to_string();
    let closed = closed.as_bytes();
    let script: &[&[&[u8]]] = &[
        &[b"DUMP", b"missing"],
        &[b"DUMP"],
        &[b"DUMP", b"a", b"b"],
        &[b"RESTORE", b"k", b"0"],
        &[b"RESTORE", b"k", b"0", t],
        &[b"GET", b"k"],
        &[b"TTL", b"k"],
        &[b"RESTORE", b"k", b"0", t],
        // The key is looked for before the deadline and the payload are.
        &[b"RESTORE", b"k", b"-1", b"junk"],
        &[b"RESTORE", b"k", b"-1", t, b"REPLACE"],
        &[b"RESTORE", b"k", b"x", t, b"REPLACE"],
        &[b"RESTORE", b"k", b"0", b"junk", b"REPLACE"],
        &[b"RESTORE", b"k", b"0", &broken, b"REPLACE"],
        &[b"RESTORE", b"k", b"0", t, b"REPLACE", b"FOO"],
        &[b"RESTORE", b"k", b"0", t, b"REPLACE", b"IDLETIME"],
        &[b"RESTORE", b"k", b"0", t, b"REPLACE", b"IDLETIME", b"-1"],
        &[b"RESTORE", b"k", b"0", t, b"REPLACE", b"IDLETIME", b"x"],
        &[b"RESTORE", b"k", b"0", t, b"REPLACE", b"FREQ", b"256"],
        &[
            b"RESTORE",
            b"k",
            b"0",
            t,
            b"REPLACE",
            b"FREQ",
            b"5",
            b"IDLETIME",
            b"5",
        ],
        &[b"RESTORE", b"k", b"0", t, b"REPLACE", b"IDLETIME", b"100"],
        &[
            b"RESTORE", b"k", b"0", t, b"REPLACE", b"FREQ", b"255", b"REPLACE",
        ],
        &[b"RESTORE", b"k", later.as_bytes(), t, b"REPLACE", b"ABSTTL"],
        &[b"EXPIRETIME", b"k"],
        // Already past: nothing stored, and a key replaced is gone.
        &[b"RESTORE", b"gone", past.as_bytes(), t, b"ABSTTL"],
        &[b"EXISTS", b"gone"],
        &[b"RESTORE", b"k", past.as_bytes(), t, b"ABSTTL", b"REPLACE"],
        &[b"EXISTS", b"k"],
        &[b"RESTORE-ASKING", b"k", b"0", t],
        &[b"GET", b"k"],
        &[b"RESTORE-ASKING", b"k"],
        // MIGRATE's reading of its arguments, and a target that cannot be reached.
        &[b"MIGRATE", b"127.0.0.1", closed, b"missing", b"0", b"100"],
        &[
            b"MIGRATE",
            b"127.0.0.1",
            closed,
            b"",
            b"0",
            b"100",
            b"KEYS",
            b"missing",
        ],
        &[b"MIGRATE", b"127.0.0.1", closed, b"k", b"0", b"100", b"FOO"],
        &[
            b"MIGRATE",
            b"127.0.0.1",
            closed,
            b"k",
            b"0",
            b"100",
            b"AUTH",
        ],
        &[
            b"MIGRATE",
            b"127.0.0.1",
            closed,
            b"k",
            b"0",
            b"100",
            b"AUTH2",
            b"u",
        ],
        &[b"MIGRATE", b"127.0.0.1", closed, b"k", b"x", b"100"],
        &[b"MIGRATE", b"127.0.0.1", closed, b"k", b"0", b"x", b"COPY"],
        &[
            b"MIGRATE",
            b"127.0.0.1",
            closed,
            b"k",
            b"0",
            b"100",
            b"KEYS",
            b"k",
        ],
        &[b"MIGRATE", b"127.0.0.1", closed, b"k", b"0"],
        &[
            b"COMMAND", b"GETKEYS", b"MIGRATE", b"h", b"1", b"", b"0", b"5", b"AUTH2", b"u",
            b"keys", b"KEYS", b"a", b"b",
        ],
        &[
            b"COMMAND", b"GETKEYS", b"MIGRATE", b"h", b"1", b"k", b"0", b"5", b"COPY",
        ],
    ];
    let differ: Vec<String> = script
        .iter()
        .filter_map(|words| {
            let (a, b) = (ours.call(words), theirs.call(words));
            let shown: Vec<_> = words.iter().map(|w| String::from_utf8_lossy(w)).collect();
            (a != b).then(|| format!("{shown:?}: {a:?}, Redis {b:?}"))
        })
        .collect();
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    // Redis says it failed writing to a target that refused the connection.
    let unreachable = ours.call(&[&b"MIGRATE"[..], b"127.0.0.1", closed, b"k", b"0", b"100"]);
    assert_eq!(
        unreachable,
        "-IOERR error or timeout connecting to the client\r\n"
    );
    // A relative deadline is from now.
    ours.call(&[&b"RESTORE"[..], b"soon", b"60000", t]);
    let left = ours.pttl("soon");
    assert!((59_000..=60_000).contains(&left), "{left}");
    let refused = ours.call(&[&b"RESTORE"[..], b"list", b"0", &list]);
    assert!(refused.starts_with("-ERR Bad data format"), "{refused}");
    assert_eq!(ours.call(&["EXISTS", "list"]), ":0\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// Redis's own `MIGRATE` moves its keys into the service (as `redis-cli --cluster
/// import` and other tools have it do), whatever encoding Redis chose for each value:
/// short and long text, integers, an empty string, LZF-compressed runs, random bytes
/// larger than a block, a deadline; and what `DUMP` gives here restores into Redis, and
/// the service's own `MIGRATE` moves them back into Redis.
#[test]
fn keys_move_between_redis_and_the_service_as_redis_moves_them() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-migrate");
    let mut theirs = Resp::connect(redis_port);
    let repeated: Vec<u8> = b"layer-0:".iter().cycle().take(100_000).copied().collect();
    let values: Vec<(&str, Vec<u8>)> = vec![
        ("text", b"hello".to_vec()),
        ("int", b"12345".to_vec()),
        ("negative", b"-5".to_vec()),
        ("wide", b"4294967296".to_vec()),
        ("empty", Vec::new()),
        (
            "long-text",
            b"0123456789abcdefghijklmnopqrstuvwxyz".to_vec(),
        ),
        ("repeated", repeated),
        ("random", value(70_000, 7)),
        ("expiring", b"for a while".to_vec()),
    ];
    for (key, v) in &values {
        assert_eq!(theirs.call(&[&b"SET"[..], key.as_bytes(), v]), "+OK\r\n");
    }
    theirs.call(&["PEXPIRE", "expiring", "600000"]);
    let keys: Vec<&str> = values.iter().map(|(k, _)| *k).collect();
    let port = kv.port.to_string();
    let migrate = |options: &[&'static str]| migrate_request(&port, options, &keys);
    let mut theirs = Resp::connect(redis_port);
    assert_eq!(theirs.call(&migrate(&["COPY"])), "+OK\r\n");
    // Already there: Redis passes on the service's refusal, then replaces them.
    let again = theirs.call(&migrate(&["COPY"]));
    assert!(
        again.contains("BUSYKEY Target key name already exists."),
        "{again}"
    );
    assert_eq!(theirs.call(&migrate(&["COPY", "REPLACE"])), "+OK\r\n");
    let mut ours = Resp::connect(kv.port);
    for (key, v) in &values {
        ours.send(&["GET", key]);
        assert_eq!(&ours.bulk(), v, "{key}");
    }
    let left = ours.pttl("expiring");
    assert!((590_000..=600_000).contains(&left), "{left}");
    assert_eq!(ours.call(&["TTL", "text"]), ":-1\r\n");
    // And back: each payload made here restores into Redis as the same value.
    for (key, v) in &values {
        let payload = ours.dump(key);
        let back = format!("back:{key}");
        let restored = theirs.call(&[&b"RESTORE"[..], back.as_bytes(), b"0", &payload]);
        assert_eq!(restored, "+OK\r\n", "{key}");
        theirs.send(&["GET", &back]);
        assert_eq!(&theirs.bulk(), v, "{key}");
    }
    // And with the service's own MIGRATE: refused while Redis holds the keys, as Redis
    // passes on a refusal, then replacing them; the keys leave the service.
    let redis_port = redis_port.to_string();
    let to_redis = |options: &[&'static str]| migrate_request(&redis_port, options, &keys);
    let refused =
        "-ERR Target instance replied with error: BUSYKEY Target key name already exists.\r\n";
    assert_eq!(ours.call(&to_redis(&[])), refused);
    assert_eq!(theirs.call(&["SET", "text", "stale"]), "+OK\r\n");
    assert_eq!(ours.call(&to_redis(&["REPLACE"])), "+OK\r\n");
    assert_eq!(ours.call(&["DBSIZE"]), ":0\r\n");
    for (key, v) in &values {
        theirs.send(&["GET", key]);
        assert_eq!(&theirs.bulk(), v, "{key}");
    }
    let left = theirs.pttl("expiring");
    assert!((590_000..=600_000).contains(&left), "{left}");
    assert_eq!(ours.call(&to_redis(&[])), "+NOKEY\r\n");
    assert_eq!(kv.terminate(), 0);
}

/// `MIGRATE` keeps its connection for the next to the same place, as Redis does: one
/// connection for several, another database selected on it; a target restarted meanwhile
/// is connected to again; unused for ten seconds, it is closed.
#[test]
fn migrate_keeps_its_connection_as_redis_does() {
    let (dir, kv, redis, redis_port) = beside_redis("kv-migrate-kept");
    let mut ours = Resp::connect(kv.port);
    for key in ["a", "b", "c", "d"] {
        assert_eq!(ours.call(&["SET", key, key]), "+OK\r\n");
    }
    let info = |field: &str| {
        let mut theirs = Resp::connect(redis_port);
        let info = theirs.call(&["INFO"]);
        let line = (info.lines()).find_map(|l| l.strip_prefix(&format!("{field}:")));
        line.and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no {field} in {info}"))
    };
    let port = redis_port.to_string();
    let before = info("total_connections_received");
    for key in ["a", "b"] {
        let words = ["MIGRATE", "127.0.0.1", &port, key, "0", "5000"];
        assert_eq!(ours.call(&words), "+OK\r\n");
    }
    let words = ["MIGRATE", "127.0.0.1", &port, "c", "1", "5000"];
    assert_eq!(ours.call(&words), "+OK\r\n");
    // One for the three, and this INFO's.
    assert_eq!(info("total_connections_received"), before + 2);
    let mut theirs = Resp::connect(redis_port);
    assert_eq!(
        theirs.call(&["MGET", "a", "b", "c"]),
        "*3\r\n$1\r\na\r\n$1\r\nb\r\n$-1\r\n"
    );
    assert_eq!(theirs.call(&["SELECT", "1"]), "+OK\r\n");
    assert_eq!(theirs.call(&["GET", "c"]), "$1\r\nc\r\n");
    drop((theirs, redis));
    let _redis = redis_server(&dir, redis_port);
    let words = ["MIGRATE", "127.0.0.1", &port, "d", "0", "5000"];
    assert_eq!(ours.call(&words), "+OK\r\n");
    assert_eq!(Resp::connect(redis_port).call(&["GET", "d"]), "$1\r\nd\r\n");
    assert_eq!(info("connected_clients"), 2);
    let deadline = Instant::now() + Duration::from_secs(20);
    while info("connected_clients") > 1 {
        assert!(
            Instant::now() < deadline,
            "the connection kept is still open"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(kv.terminate(), 0);
}

/// `MIGRATE` of `keys` to 127.0.0.1:`port` within 5 s, with `options`.
fn migrate_request<'a>(port: &'a str, options: &[&'a str], keys: &[&'a str]) -> Vec<&'a str> {
    let mut words = vec!["MIGRATE", "127.0.0.1", port, "", "0", "5000"];
    words.extend_from_slice(options);
    words.push("KEYS");
    words.extend_from_slice(keys);
    words
}

/// Over TLS, keys move as between Redises with `tls-cluster yes`: the service's `MIGRATE`
/// verifies the target with the CA of `tls_client_ca` and presents its own certificate,
/// into a Redis speaking only TLS and another service, and Redis's `MIGRATE` into the
/// service comes over TLS the same way. A service over TLS without `tls_client_ca` moves
/// nothing (it could not tell where the keys went), and a target speaking plaintext gets
/// nothing.
#[test]
fn over_tls_keys_move_between_redis_and_the_service() {
    let dir = Scratch::new("kv-migrate-tls");
    certificates(&dir);
    let p = |f: &str| dir.path(f);
    let files = |ca: bool| {
        let ca = if ca {
            format!("tls_client_ca \"{}\"", p("ca.pem"))
        } else {
            String::new()
        };
        format!(
            "tls_cert \"{}\" tls_key \"{}\" {ca}",
            p("node.pem"),
            p("node.key")
        )
    };
    let kv = KvService::start_with(
        &dir,
        &format!("file://{}", p("a.img")),
        "4MiB",
        &files(true),
    );
    let other_dir = Scratch::new("kv-migrate-tls-b");
    let unverifying = KvService::start_with(
        &other_dir,
        &format!("file://{}", other_dir.path("b.img")),
        "4MiB",
        &files(false),
    );
    let redis_port = free_port();
    // Listening on `port`, in plaintext unless `tls` says otherwise.
    let redis = |port: u16, tls: &[&str]| {
        let plain = if tls.is_empty() { port } else { 0 };
        let server = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", &p("")])
            .args(["--port", &plain.to_string()])
            .args(tls)
            .stdout(Stdio::null())
            .spawn()
            .expect("`redis-server` is required (scripts/test installs it)");
        wait_for_port(port, "redis-server");
        Running(server)
    };
    let tls_port = redis_port.to_string();
    let _tls_redis = redis(
        redis_port,
        &[
            "--tls-port",
            &tls_port,
            "--tls-cert-file",
            &p("node.pem"),
            "--tls-key-file",
            &p("node.key"),
            "--tls-ca-cert-file",
            &p("ca.pem"),
            "--tls-cluster",
            "yes",
        ],
    );
    let (ca, cert, key) = (p("ca.pem"), p("client.pem"), p("client.key"));
    let cli = |port: u16, args: &[&str]| {
        let port = port.to_string();
        let mut all = vec!["-h", "127.0.0.1", "-p", &port, "--tls", "--cacert", &ca];
        all.extend_from_slice(&["--cert", &cert, "--key", &key]);
        all.extend_from_slice(args);
        String::from_utf8_lossy(&tool("redis-cli", &all).stdout)
            .trim_end()
            .to_owned()
    };
    let values: Vec<(String, String)> = (0..6)
        .map(|i| (format!("layer:{i}"), format!("{i}-").repeat(1 << (i * 3))))
        .collect();
    for (k, v) in &values {
        assert_eq!(cli(kv.port, &["SET", k, v]), "OK");
    }
    let keys: Vec<&str> = values.iter().map(|(k, _)| k.as_str()).collect();
    let to = |port: u16| port.to_string();
    let (redis_at, kv_at, unverifying_at) = (to(redis_port), to(kv.port), to(unverifying.port));
    let reads_back = |port: u16| {
        for (k, v) in &values {
            assert_eq!(&cli(port, &["GET", k]), v, "{k} on {port}");
        }
    };
    assert_eq!(cli(kv.port, &migrate_request(&redis_at, &[], &keys)), "OK");
    assert_eq!(cli(kv.port, &["DBSIZE"]), "0");
    reads_back(redis_port);
    assert_eq!(cli(redis_port, &migrate_request(&kv_at, &[], &keys)), "OK");
    reads_back(kv.port);
    assert_eq!(cli(redis_port, &["DBSIZE"]), "0");
    // Service to service.
    let to_other = migrate_request(&unverifying_at, &["COPY"], &keys);
    assert_eq!(cli(kv.port, &to_other), "OK");
    reads_back(unverifying.port);
    let refused = cli(unverifying.port, &migrate_request(&redis_at, &[], &keys));
    assert!(refused.contains("needs `tls_client_ca`"), "{refused}");
    assert_eq!(cli(unverifying.port, &["DBSIZE"]), "6");
    assert_eq!(cli(redis_port, &["DBSIZE"]), "0");
    let plain_port = free_port();
    let _plain_redis = redis(plain_port, &[]);
    let plain_at = plain_port.to_string();
    let failed = cli(kv.port, &migrate_request(&plain_at, &[], &keys));
    assert!(failed.starts_with("IOERR"), "{failed}");
    let plain = tool_ok("redis-cli", &["-p", &plain_at, "DBSIZE"]);
    assert_eq!(plain.trim(), "0");
    assert_eq!(cli(kv.port, &["DBSIZE"]), "6");
    assert_eq!((kv.terminate(), unverifying.terminate()), (0, 0));
}

/// The request of `words`, as a client sends it.
fn request<W: AsRef<[u8]>>(words: &[W]) -> Vec<u8> {
    let mut req = format!("*{}\r\n", words.len()).into_bytes();
    for w in words.iter().map(AsRef::as_ref) {
        req.extend_from_slice(format!("${}\r\n", w.len()).as_bytes());
        req.extend_from_slice(w);
        req.extend_from_slice(b"\r\n");
    }
    req
}

/// Pipelined `RESTORE`s, as `MIGRATE` sends them, answered as Redis answers them: random
/// runs over a few keys (a key again in its run, `REPLACE` or not, deadlines ahead, past
/// or invalid, payloads Redis made and bytes that are none), every reply the same, and
/// the same values left with deadlines alike.
#[test]
fn pipelined_restores_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-restore-runs");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let mut payloads: Vec<Vec<u8>> = Vec::new();
    for v in [
        b"hello".to_vec(),
        b"12345".to_vec(),
        value(20_000, 3),
        vec![b'x'; 30_000],
    ] {
        assert_eq!(theirs.call(&[&b"SET"[..], b"source", &v]), "+OK\r\n");
        payloads.push(theirs.dump("source"));
    }
    theirs.call(&["DEL", "source"]);
    payloads.push(b"not a payload".to_vec());
    let mut next = numbers(0x5851_f42d_4c95_7f2d);
    let relative = ["0", "0", "100000", "-5", "x"];
    let absolute = ["1", "4000000000000"];
    let mut differ = Vec::new();
    let mut kinds = std::collections::BTreeSet::new();
    for round in 0..300 {
        let n = 1 + next(12);
        let mut pipeline = Vec::new();
        for _ in 0..n {
            let key = format!("k{}", next(4));
            let at = next(4) == 0;
            let ttl = if at {
                absolute[next(absolute.len())]
            } else {
                relative[next(relative.len())]
            };
            let payload = &payloads[next(payloads.len())];
            let mut words: Vec<&[u8]> = vec![b"RESTORE", key.as_bytes(), ttl.as_bytes(), payload];
            if next(2) == 0 {
                words.push(b"REPLACE");
            }
            if at {
                words.push(b"ABSTTL");
            }
            pipeline.extend(request(&words));
        }
        ours.send_raw(&pipeline);
        theirs.send_raw(&pipeline);
        for i in 0..n {
            let (a, b) = (ours.reply(), theirs.reply());
            if a != b {
                differ.push(format!("round {round}, request {i}: {a:?}, Redis {b:?}"));
            }
            kinds.insert(b.split(' ').next().map(str::to_owned));
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    // Each kind of answer came up: `OK`, `BUSYKEY` and the `ERR`s.
    assert_eq!(kinds.len(), 3, "{kinds:?}");
    let sign = |ms: i64| ms.clamp(-2, 1);
    for key in ["k0", "k1", "k2", "k3"] {
        assert_eq!(
            ours.call(&["GET", key]),
            theirs.call(&["GET", key]),
            "{key}"
        );
        assert_eq!(sign(ours.pttl(key)), sign(theirs.pttl(key)), "{key}");
    }
    assert_eq!(kv.terminate(), 0);
}

/// A Redis's keys imported into a cluster of services with `redis-cli --cluster
/// import` (which has the Redis `MIGRATE` each key to the node serving its slot): every
/// key on its own node with its value and deadline, through the nodes' password, read
/// back through redis-py's cluster client, and the cluster checked whole; then a
/// service's keys moved into the cluster the same way, by its own `MIGRATE`.
#[test]
fn redis_cli_imports_a_redis_into_a_cluster_of_services() {
    let (ports, _dirs, kvs) = two_nodes("kv-import", |first| {
        let secret = first.path("kv.secret");
        // Without a space: redis-cli 7.0 splits the password it puts in MIGRATE at one.
        std::fs::write(&secret, "move-it\n").expect("secret");
        format!("password_file \"{secret}\"")
    });
    let (_dir, _plain, _redis, redis_port) = beside_redis("kv-import-source");
    let script = format!(
        r#"
import redis
r = redis.Redis(port={redis_port})
for i in range(200):
    r.set(f"chunk:{{i}}", bytes([i]) * (i * 331 % 9000))
r.set("chunk:17", b"expiring", px=600000)
print("ok")
"#
    );
    redis_py_ok(&script, "filling the Redis to import");
    let node = format!("127.0.0.1:{}", ports[0]);
    let from = format!("127.0.0.1:{redis_port}");
    let cli = |args: &[&str]| {
        let mut all = vec!["-a", "move-it", "--no-auth-warning", "--cluster"];
        all.extend_from_slice(args);
        tool_ok("redis-cli", &all)
    };
    // The Redis authenticates to each node with the password given (`AUTH` in MIGRATE).
    let import = cli(&["import", &node, "--cluster-from", &from, "--cluster-copy"]);
    assert!(!import.contains("ERR"), "{import}");
    let check = cli(&["check", &node]);
    assert!(check.contains("[OK] 200 keys in 2 masters."), "{check}");
    let script = format!(
        r#"
import redis
from redis.cluster import RedisCluster, ClusterNode
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {a})], password="move-it")
for i in range(200):
    want = b"expiring" if i == 17 else bytes([i]) * (i * 331 % 9000)
    assert rc.get(f"chunk:{{i}}") == want, i
assert 590000 <= rc.pttl("chunk:17") <= 600000
assert rc.ttl("chunk:18") == -1
nodes = [redis.Redis(port=p, password="move-it") for p in ({a}, {b})]
for n, here in zip(nodes, (range(0, 8192), range(8192, 16384))):
    assert 50 < n.dbsize() < 150
    for k in n.keys("*"):
        assert rc.keyslot(k) in here, k
print("ok")
"#,
        a = ports[0],
        b = ports[1],
    );
    redis_py_ok(&script, "reading the imported keys through the cluster");
    // From a service alone into the cluster: the source's own MIGRATE, which moves them
    // (no `--cluster-copy`), over a value the cluster holds (`--cluster-replace`).
    let alone_dir = Scratch::new("kv-import-alone");
    let alone = KvService::start(
        &alone_dir,
        &format!("file://{}", alone_dir.path("blocks.img")),
        "16MiB",
    );
    let script = format!(
        r#"
import redis
r = redis.Redis(port={port})
for i in range(150, 250):
    r.set(f"chunk:{{i}}", b"from the service %d" % i, px=600000 if i % 2 else None)
print("ok")
"#,
        port = alone.port
    );
    redis_py_ok(&script, "filling a service to import");
    let from = format!("127.0.0.1:{}", alone.port);
    let import = cli(&[
        "import",
        &node,
        "--cluster-from",
        &from,
        "--cluster-replace",
    ]);
    assert!(!import.contains("ERR"), "{import}");
    assert!(cli(&["check", &node]).contains("[OK] 250 keys in 2 masters."));
    assert_eq!(alone.cli(&["DBSIZE"]).trim(), "0");
    let script = format!(
        r#"
from redis.cluster import RedisCluster, ClusterNode
rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", {a})], password="move-it")
for i in range(150, 250):
    assert rc.get(f"chunk:{{i}}") == b"from the service %d" % i, i
    if i % 2:
        assert 590000 <= rc.pttl(f"chunk:{{i}}") <= 600000
    else:
        assert rc.ttl(f"chunk:{{i}}") == -1
print("ok")
"#,
        a = ports[0],
    );
    redis_py_ok(&script, "reading the keys imported from a service");
    assert_eq!(alone.terminate(), 0);
    for kv in kvs {
        assert_eq!(kv.terminate(), 0);
    }
}

/// What each server sends back for `bytes` on a fresh connection, `<closed>` appended
/// once it closes: all it sends before `quiet` passes with nothing more, or, given
/// `expect`, until it has sent as many bytes (or closed, or 10 s passed).
fn raw_answer(port: u16, bytes: &[u8], quiet: Duration, expect: Option<usize>) -> Vec<u8> {
    use std::io::Read;
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(bytes).expect("send");
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let enough = expect.is_some_and(|n| out.len() >= n);
        let wait = match expect {
            Some(_) if !enough => deadline.saturating_duration_since(Instant::now()),
            _ => quiet,
        };
        if wait.is_zero() {
            return out;
        }
        s.set_read_timeout(Some(wait)).expect("timeout");
        match s.read(&mut chunk) {
            Ok(0) => {
                out.extend_from_slice(b"<closed>");
                return out;
            }
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                out.extend_from_slice(b"<closed>");
                return out;
            }
            Err(_) => return out,
        }
    }
}

/// Malformed and inline requests, byte for byte, to the service and to a redis-server:
/// the same answers, and the connection closed where Redis closes it. (Where they
/// differ on purpose: a bulk string not followed by CRLF is refused here, where Redis
/// skips two bytes whatever they are; a request of more than a million arguments is
/// refused at once; inline commands take double quotes without escapes, not single
/// quotes.)
#[test]
fn protocol_errors_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-protocol");
    let cases: &[&[u8]] = &[
        b"*-1\r\n",
        b"*0\r\nPING\r\n",
        b"*1\r\n$-1\r\n",
        b"*1\r\n$4\r\nPING\r\n",
        b"\r\nPING\r\n",
        b"\nPING\n",
        b"SET a \"b c\"\r\nGET a\r\n",
        b"SET a \"unterminated\r\n",
        b"*1\r\n+PING\r\n",
        b"*1\r\n:1\r\n",
        b"*x\r\n",
        b"*2\r\n$x\r\n",
        b"*1\r\n$600000000\r\n",
        b"$4\r\nPING\r\n",
        b"   PING   \r\n",
        b"ECHO a  b\r\n",
        b"PING\r\n\r\n\r\nPING\r\n",
        b"*2\r\n$4\r\nECHO\r\n$0\r\n\r\n",
        // Inline commands as Redis splits them (sdssplitargs): escapes in double
        // quotes, single quotes, quotes inside a word, and where they are unbalanced.
        b"ECHO \"a\\nb\\x41\\x4g\\\"c\\\\\"\r\n",
        b"ECHO 'it\\'s' 'a\\nb'\r\n",
        b"ECHO ab\"c d\"e'f g'\r\n",
        b"ECHO \"a\"b\r\n",
        b"ECHO 'a'b\r\n",
        b"ECHO 'unterminated\r\n",
        b"ECHO \"a\\\"\r\n",
        b"ECHO a\x0bb\x0c\r\n",
        b"ECHO \"a\"\x0bb\r\n",
        b"ECHO a\0b c\r\nPING\r\n",
        b"SET \"\" \"\"\r\nGET \"\"\r\nECHO ''\r\n",
    ];
    let quiet = Duration::from_millis(300);
    let differ: Vec<String> = cases
        .iter()
        .filter_map(|&c| {
            let theirs = raw_answer(redis_port, c, quiet, None);
            let ours = raw_answer(kv.port, c, quiet, Some(theirs.len()));
            (ours != theirs).then(|| {
                let show = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
                format!(
                    "{:?}: {:?}, Redis {:?}",
                    show(c),
                    show(&ours),
                    show(&theirs)
                )
            })
        })
        .collect();
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert_eq!(kv.terminate(), 0);
}

/// Random commands of the string and expiry families, options and all, on a few keys,
/// to the service and to a redis-server alike: every reply the same (a remaining time
/// compared by sign, the two clocks being read a moment apart), and the same keys left.
#[test]
fn random_commands_answer_as_redis_does() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-random");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let mut next = numbers(0x2545_f491_4f6c_dd1d);
    // Deadlines far ahead (at least 100 s: none passes during the run, which Redis would
    // still count in DBSIZE until it looked at the key), or long past (the …AT forms'
    // 300000, in 1970), or not deadlines at all.
    let amounts = [
        "100000",
        "4000000000",
        "4000000000000",
        "300000",
        "0",
        "-1",
        "x",
    ];
    let options = [
        "EX", "PX", "EXAT", "PXAT", "NX", "XX", "GT", "LT", "KEEPTTL", "PERSIST", "GET",
    ];
    let commands = [
        "SET",
        "SETEX",
        "PSETEX",
        "SETNX",
        "GETSET",
        "GET",
        "GETDEL",
        "GETEX",
        "DEL",
        "EXISTS",
        "STRLEN",
        "TYPE",
        "MSET",
        "MGET",
        "EXPIRE",
        "PEXPIRE",
        "EXPIREAT",
        "PEXPIREAT",
        "TTL",
        "PTTL",
        "EXPIRETIME",
        "PEXPIRETIME",
        "PERSIST",
        // Transactions among them: what an EXEC answers is the replies of those queued.
        "MULTI",
        "EXEC",
        "DISCARD",
        "WATCH",
        "UNWATCH",
    ];
    let mut differ = Vec::new();
    for _ in 0..3000 {
        let command = commands[next(commands.len())];
        let mut words = vec![command.to_string()];
        for _ in 0..next(4) {
            words.push(format!("k{}", next(4)));
        }
        if command.contains("SET") || command.contains("EXPIRE") || command == "GETEX" {
            for _ in 0..next(4) {
                let option = options[next(options.len())];
                words.push(option.to_string());
                if option.ends_with('X') && option != "NX" && option != "XX"
                    || option.ends_with("AT")
                    || next(3) == 0
                {
                    words.push(amounts[next(amounts.len())].to_string());
                }
            }
        }
        let words: Vec<&str> = words.iter().map(String::as_str).collect();
        let remaining = matches!(command, "TTL" | "PTTL" | "EXPIRETIME" | "PEXPIRETIME");
        let reply = |r: &mut Resp| {
            let reply = r.call(&words);
            match reply
                .strip_prefix(':')
                .and_then(|n| n.trim().parse::<i64>().ok())
            {
                Some(n) if remaining && n > 0 => ":(positive)".to_string(),
                // An EXEC's array: times left and deadlines (the only numbers past
                // 999 here) as they were when each server ran them.
                _ => (reply.split_inclusive("\r\n"))
                    .map(
                        |line| match line.strip_prefix(':').map(|n| n.trim().parse::<i64>()) {
                            Some(Ok(n)) if n > 999 => ":(large)\r\n",
                            _ => line,
                        },
                    )
                    .collect(),
            }
        };
        let (a, b) = (reply(&mut ours), reply(&mut theirs));
        if a != b {
            differ.push(format!("{words:?}: {a:?}, Redis {b:?}"));
        }
    }
    assert!(
        differ.is_empty(),
        "{} differ:\n{}",
        differ.len(),
        differ.join("\n")
    );
    // The keys left, listed (DBSIZE is not compared: Redis counts a key whose deadline
    // has passed until it removes it, which it does lazily or by sampling).
    assert_eq!(ours.keys("*"), theirs.keys("*"));
    assert_eq!(kv.terminate(), 0);
}

/// `KEYS` patterns against a real redis-server over the same keys: Redis's glob, its
/// sets, ranges, escapes and unclosed brackets, key for key; then 2000 patterns made at
/// random of those bytes.
#[test]
fn patterns_match_as_redis_matches_them() {
    let (_dir, kv, _redis, redis_port) = beside_redis("kv-patterns");
    let (mut ours, mut theirs) = (Resp::connect(kv.port), Resp::connect(redis_port));
    let keys = [
        "a",
        "b",
        "ab",
        "abc",
        "a*b",
        "a?c",
        "a-b",
        "a]b",
        "a\\b",
        "[x]",
        "\\",
        "]",
        "^",
        "-",
        "hello",
        "hallo",
        "hxllo",
        "hllo",
        "heeello",
        "h]llo",
        "h-llo",
        "h^llo",
        "layer0:chunk1",
        "layer10:chunk2",
        "",
    ];
    for k in keys {
        for r in [&mut ours, &mut theirs] {
            assert_eq!(r.call(&["SET", k, "1"]), "+OK\r\n", "{k:?}");
        }
    }
    let patterns = [
        "*",
        "**",
        "?",
        "??",
        "a*",
        "*b",
        "a?c",
        "a\\*b",
        "a\\?c",
        "h?llo",
        "h*llo",
        "h[ae]llo",
        "h[^e]llo",
        "h[a-e]llo",
        "h[e-a]llo",
        "h[a-]llo",
        "h[-a]llo",
        "h[]]llo",
        "h[\\]]llo",
        "h[^]llo",
        "h[",
        "h[a",
        "[",
        "[]",
        "[^]",
        "\\",
        "a\\",
        "*\\",
        "a\\\\b",
        "[[]x]",
        "layer?:*",
        "layer*:chunk[12]",
        "*:*",
        "a[-]b",
        "a[]-]b",
        "a[\\-]b",
        "h[a-e-x]llo",
        "[a-]",
        "[-]",
        "[^a-z]",
        "*[",
        "*[]",
    ];
    let listed = |r: &mut Resp, pattern: &str| r.keys(pattern).join(" | ");
    // And patterns made at random of the bytes that mean something to a glob.
    let mut next = numbers(0x9e37_79b9_7f4a_7c15);
    let glob = b"ab*?[]^-\\h";
    let random = (0..2000).map(|_| {
        let len = 1 + next(8);
        (0..len)
            .map(|_| glob[next(glob.len())] as char)
            .collect::<String>()
    });
    let patterns = patterns.iter().map(|p| p.to_string()).chain(random);
    let differ: Vec<String> = patterns
        .filter_map(|p| {
            let (a, b) = (listed(&mut ours, &p), listed(&mut theirs, &p));
            (a != b).then(|| format!("{p:?}: [{a}], Redis [{b}]"))
        })
        .collect();
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert_eq!(kv.terminate(), 0);
}

/// With `tls_cert` and `tls_key` the service speaks only TLS: redis-cli and redis-py
/// connect with the CA's certificate and store and read; a plaintext client gets nothing.
/// With `tls_client_ca`, only a client presenting a certificate that CA signed gets in.
/// SIGHUP reads the files again, so a rotated certificate serves without a restart.
#[test]
fn over_tls_the_tools_store_and_read_and_plaintext_gets_nothing() {
    let dir = Scratch::new("kv-tls");
    certificates(&dir);
    let p = |f: &str| dir.path(f);
    let target = format!("file://{}", p("blocks.img"));
    let files = format!(
        "tls_cert \"{}\"  tls_key \"{}\"",
        p("server.pem"),
        p("server.key")
    );
    let kv = KvService::start_with(&dir, &target, "4MiB", &files);
    let port = kv.port.to_string();
    let ca = p("ca.pem");
    let tls_cli = |args: &[&str]| {
        let mut all = vec!["-h", "127.0.0.1", "-p", &port, "--tls", "--cacert", &ca];
        all.extend_from_slice(args);
        tool("redis-cli", &all)
    };
    let out = tls_cli(&["SET", "layer", "over tls"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "OK", "{out:?}");
    let out = tls_cli(&["GET", "layer"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "over tls");
    let py = tool(
        PYTHON,
        &[
            "-c",
            &format!(
                "import redis\nr = redis.Redis(host='127.0.0.1', port={port}, ssl=True, \
                 ssl_ca_certs='{ca}')\nr.set('py', b'x' * 100000)\n\
                 assert r.get('py') == b'x' * 100000\nprint(r.get('layer').decode())"
            ),
        ],
    );
    assert_eq!(
        String::from_utf8_lossy(&py.stdout).trim(),
        "over tls",
        "redis-py: {}",
        String::from_utf8_lossy(&py.stderr)
    );
    // In the clear, the request is not a TLS handshake: no reply.
    let mut plain = Resp::connect(kv.port);
    plain
        .stream
        .get_mut()
        .set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let mut line = String::new();
    plain
        .stream
        .get_mut()
        .write_all(b"*1\r\n$4\r\nPING\r\n")
        .expect("send");
    let got = std::io::BufRead::read_line(&mut plain.stream, &mut line);
    assert!(
        !line.starts_with("+PONG"),
        "plaintext answered: {got:?} {line:?}"
    );
    assert_eq!(kv.terminate(), 0);

    let mutual = format!("{files}  tls_client_ca \"{ca}\"");
    let kv = KvService::start_with(&dir, &target, "4MiB", &mutual);
    let port = kv.port.to_string();
    let base = ["-h", "127.0.0.1", "-p", &port, "--tls", "--cacert", &ca];
    let without = tool("redis-cli", &[&base[..], &["PING"]].concat());
    assert!(
        !String::from_utf8_lossy(&without.stdout).contains("PONG"),
        "a client without a certificate got in"
    );
    let (cert, key) = (p("client.pem"), p("client.key"));
    let with = tool(
        "redis-cli",
        &[&base[..], &["--cert", &cert, "--key", &key, "PING"]].concat(),
    );
    assert_eq!(
        String::from_utf8_lossy(&with.stdout).trim(),
        "PONG",
        "{with:?}"
    );
    // The client without a certificate is counted.
    assert!(kv.metric("dpuflow_kvcache_tls_failures_total{service=\"kvcache\"}") >= 1);

    // The certificate rotated in place (now from another CA), then SIGHUP: new connections
    // get the new one, trusted by the new CA only.
    let rotated = Scratch::new("kv-tls-rotated");
    certificates(&rotated);
    for f in ["server.pem", "server.key"] {
        std::fs::copy(rotated.path(f), p(f)).expect("rotate");
    }
    tool_ok("kill", &["-HUP", &kv.child.0.id().to_string()]);
    let new_ca = rotated.path("ca.pem");
    let client = ["--cert", &cert, "--key", &key, "PING"];
    let renewed = ["-h", "127.0.0.1", "-p", &port, "--tls", "--cacert", &new_ca];
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&tool("redis-cli", &[&renewed[..], &client].concat()).stdout)
        .contains("PONG")
    {
        assert!(
            Instant::now() < deadline,
            "the rotated certificate never served"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let old = tool("redis-cli", &[&base[..], &client].concat());
    assert!(!String::from_utf8_lossy(&old.stdout).contains("PONG"));
    assert_eq!(kv.terminate(), 0);

    // A key that is not the certificate's fails the start, naming both files.
    let pipe = p("mismatch.pipe");
    std::fs::write(
        &pipe,
        format!(
            "pipeline kv\nport fabric {{ driver pcap }}\n\
             service kvcache {{ listen 127.0.0.1:{}  target \"{target}\"  capacity 4MiB  \
             tls_cert \"{}\"  tls_key \"{}\" }}\n\
             pipe p root from fabric {{ default {{ actions to kvcache }} }}\n",
            free_port(),
            p("server.pem"),
            p("client.key")
        ),
    )
    .expect("write pipeline");
    let out = dpuflow(&["run", &pipe]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("server.pem with") && err.contains("client.key"),
        "{err}"
    );
}
