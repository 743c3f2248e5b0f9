use super::*;
use crate::ir::StorageTarget;
use crate::kvcache::index::SNAPSHOT_PART;

/// A value read from the target lands on a cache line (or a sector), whatever the
/// reply's header length; what is sent starts with the header; later replies follow
/// it unaligned.
#[test]
fn a_large_value_read_from_the_target_lands_on_a_cache_line() {
    for align in [CACHE_LINE, 4096] {
        for len in [1, 9, 10, 99_999, 4_000_000, 16_000_000] {
            let mut out = Replies::with_capacity(READ_BUFFER);
            out.align_value(len, align);
            reply::bulk_header(&mut out, len);
            assert_eq!((out.as_ptr() as usize + out.len()) % align, 0, "{len}");
            assert_eq!(out.pending(), format!("${len}\r\n").as_bytes());
            assert!(out.capacity() >= out.len() + len + 2, "room for it all");
            // Only the first reply of a batch is placed.
            let sent = out.len();
            out.align_value(len, align);
            assert_eq!(out.len(), sent);
            out.clear();
            assert!(out.pending().is_empty());
        }
    }
}

/// A large value's request still arriving is placed so that the value will start on
/// the value alignment (a target's sector, read and written directly), whole in the
/// buffer: in room made for it, then within that room for the next values, whatever
/// their keys' lengths; the bytes that arrived are kept.
#[test]
fn a_large_value_arriving_is_placed_on_the_value_alignment() {
    let (svc, path) = service("place", 4 << 20, 4096);
    let align = svc.value_alignment();
    let mut buf = vec![0u8; READ_BUFFER];
    for (key, len) in [(1, 300_000), (7, 300_001), (30, 70_000), (2, 299_000)] {
        let header = format!(
            "*3\r\n$3\r\nSET\r\n${key}\r\n{}\r\n${len}\r\n",
            "k".repeat(key)
        );
        let arrived: Vec<u8> = header.bytes().chain((0..1000).map(|i| i as u8)).collect();
        let start = 5;
        buf[start..start + arrived.len()].copy_from_slice(&arrived);
        let a = Awaited {
            len: header.len() + len + 2,
            data: header.len(),
        };
        let at;
        (buf, at) = svc.place(buf, start..start + arrived.len(), a);
        assert_eq!(
            (buf.as_ptr() as usize + at + a.data) % align,
            0,
            "{key}, {len}"
        );
        assert_eq!(&buf[at..at + arrived.len()], &arrived[..]);
        assert!(buf.len() >= at + a.len, "room for the whole request");
    }
    std::fs::remove_file(path).unwrap();
}

/// Several large values read in one share: the first keeps its place on the value
/// alignment while the replies after it are laid out (room for them all is made
/// first), and every reply is whole.
#[test]
fn a_share_of_several_values_keeps_the_first_in_place() {
    let (svc, path) = service("share", 8 << 20, 4096);
    let names: Vec<Vec<u8>> = (0..4).map(|i| format!("k{i}").into_bytes()).collect();
    let value = vec![7u8; 300_000];
    for k in &names {
        run(&svc, &[b"SET", k, &value]);
    }
    let keys: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    let mut out = Replies::with_capacity(READ_BUFFER);
    assert_eq!(svc.values_share(&keys, &mut out, Proto::Resp2), 4);
    let header = reply::bulk_header_len(value.len());
    let first = out.as_ptr() as usize + out.from + header;
    assert_eq!(first % svc.value_alignment(), 0);
    let one = [format!("${}\r\n", value.len()).as_bytes(), &value, b"\r\n"].concat();
    assert_eq!(out.pending(), one.repeat(4));
    std::fs::remove_file(path).unwrap();
}

/// A service on a fresh file named after the test.
fn service(test: &str, capacity: u64, block: u64) -> (Arc<KvService>, std::path::PathBuf) {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-{test}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    (on(&path, capacity, block), path)
}

/// A service on the file at `path`, as it is, every value on the target.
fn on(path: &std::path::Path, capacity: u64, block: u64) -> Arc<KvService> {
    on_with(path, capacity, block, 0)
}

/// [`on`], values of up to `inline_max` bytes kept in memory.
fn on_with(path: &std::path::Path, capacity: u64, block: u64, inline_max: u64) -> Arc<KvService> {
    in_cluster(path, capacity, block, inline_max, Vec::new())
}

/// [`on_with`], a node of the cluster of `nodes` (the first listening as it does), or
/// standalone with none.
fn in_cluster(
    path: &std::path::Path,
    capacity: u64,
    block: u64,
    inline_max: u64,
    nodes: Vec<SocketAddr>,
) -> Arc<KvService> {
    let config = KvCache {
        listen: "127.0.0.1:0".parse().unwrap(),
        targets: vec![StorageTarget::Local {
            path: path.to_owned(),
        }],
        capacity,
        block_size: block,
        stripe: 1 << 20,
        connections: 2,
        inline_max,
        checkpoint: None,
        nvme_digests: Default::default(),
        page_cache: None,
        discard: false,
        io_timeout: Duration::from_secs(30),
        max_clients: crate::ir::DEFAULT_MAX_CLIENTS,
        slowlog: Some(crate::ir::DEFAULT_SLOWLOG),
        password_file: None,
        tls: None,
        cluster: nodes,
        cluster_leaving: false,
    };
    KvService::start("kvcache", &config, Arc::new(AtomicBool::new(false))).unwrap()
}

#[test]
fn with_a_password_only_authenticated_clients_are_served() {
    let dir = std::env::temp_dir().join(format!("dpuflow-kv-{}-auth", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let secret = dir.with_extension("secret");
    std::fs::write(&secret, "s3cret\n").unwrap();
    let config = KvCache {
        listen: "127.0.0.1:0".parse().unwrap(),
        targets: vec![StorageTarget::Local { path: dir.clone() }],
        capacity: 1 << 20,
        block_size: 4096,
        stripe: 1 << 20,
        connections: 1,
        inline_max: 0,
        checkpoint: None,
        nvme_digests: Default::default(),
        page_cache: None,
        discard: false,
        io_timeout: Duration::from_secs(30),
        max_clients: crate::ir::DEFAULT_MAX_CLIENTS,
        slowlog: Some(crate::ir::DEFAULT_SLOWLOG),
        password_file: Some(secret.clone()),
        tls: None,
        cluster: Vec::new(),
        cluster_leaving: false,
    };
    let svc = KvService::start("kvcache", &config, Arc::new(AtomicBool::new(false))).unwrap();
    let talk = |c: &mut TcpStream, req: &str, expect: &str| {
        c.write_all(req.as_bytes()).unwrap();
        let mut back = vec![0u8; expect.len()];
        c.read_exact(&mut back).unwrap();
        assert_eq!(String::from_utf8_lossy(&back), expect, "{req}");
    };
    let mut c = TcpStream::connect(svc.listen).unwrap();
    talk(&mut c, "GET k\r\n", "-NOAUTH Authentication required.\r\n");
    talk(&mut c, "PING\r\n", "-NOAUTH Authentication required.\r\n");
    talk(
        &mut c,
        "AUTH nope\r\n",
        "-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    );
    talk(
        &mut c,
        "AUTH admin s3cret\r\n",
        "-WRONGPASS invalid username-password pair or user is disabled.\r\n",
    );
    talk(&mut c, "AUTH default s3cret\r\n", "+OK\r\n");
    talk(&mut c, "SET k v\r\nGET k\r\n", "+OK\r\n$1\r\nv\r\n");
    let mut c = TcpStream::connect(svc.listen).unwrap();
    talk(&mut c, "HELLO 2 AUTH default s3cret\r\n", "*14\r\n");
    // RESP3 chosen as the client authenticates: its replies from then on are in it.
    let mut c = TcpStream::connect(svc.listen).unwrap();
    let version = env!("CARGO_PKG_VERSION");
    let hello = format!(
        "%7\r\n$6\r\nserver\r\n$7\r\ndpuflow\r\n$7\r\nversion\r\n${}\r\n{version}\r\n\
         $5\r\nproto\r\n:3\r\n$2\r\nid\r\n:3\r\n$4\r\nmode\r\n$10\r\nstandalone\r\n$4\r\nrole\r\n$6\r\nmaster\r\n\
         $7\r\nmodules\r\n*0\r\n",
        version.len()
    );
    // Not authenticated, HELLO answers nothing but that (the third connection's id is 3).
    talk(
        &mut c,
        "HELLO 3 SETNAME w1\r\n",
        "-NOAUTH HELLO must be called",
    );
    let mut rest = Vec::new();
    while !rest.ends_with(b"\r\n") {
        let mut byte = [0u8];
        c.read_exact(&mut byte).unwrap();
        rest.push(byte[0]);
    }
    assert!(rest.ends_with(b"at the same time\r\n"), "{rest:?}");
    talk(&mut c, "HELLO 3 AUTH default s3cret\r\n", &hello);
    talk(&mut c, "GET nope\r\n", "_\r\n");
    assert_eq!(svc.counters.auth_failures.load(Relaxed), 2);
    // Without a password, AUTH says so.
    let (open, path) = service("no-auth", 1 << 20, 4096);
    assert!(run(&open, &[b"AUTH", b"x"]).starts_with(b"-ERR AUTH <password> called without"));
    // A missing or empty password file fails the start.
    std::fs::write(&secret, "\n").unwrap();
    assert!(matches!(
        KvService::start("kvcache", &config, Arc::new(AtomicBool::new(false))),
        Err(StartError::Password { .. })
    ));
    for f in [dir, secret, path] {
        std::fs::remove_file(f).unwrap();
    }
}

#[test]
fn a_clean_stop_keeps_the_index_for_the_next_start_only() {
    let (svc, path) = service("restart", 64 * 4096, 4096);
    let big: Vec<u8> = (0..50_000u32).map(|i| (i % 249) as u8).collect();
    run(&svc, &[b"SET", b"big", &big]);
    run(&svc, &[b"SET", b"small", b"x"]);
    run(&svc, &[b"SET", b"gone", b"y"]);
    run(&svc, &[b"DEL", b"gone"]);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    let svc = on(&path, 64 * 4096, 4096);
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":2\r\n");
    assert!(run(&svc, &[b"SAVE"]).starts_with(b"-ERR checkpoints are off"));
    let mut expect = Vec::new();
    reply::bulk(&mut expect, &big);
    assert_eq!(run(&svc, &[b"GET", b"big"]), expect);
    assert_eq!(run(&svc, &[b"GET", b"small"]), b"$1\r\nx\r\n");
    // New values go to blocks the restored keys do not hold.
    run(&svc, &[b"SET", b"new", &[7u8; 30_000]]);
    assert_eq!(run(&svc, &[b"GET", b"big"]), expect);
    // No clean stop this time: the next start is empty, and so is one with another
    // block size after a clean stop.
    drop(svc);
    let svc = on(&path, 64 * 4096, 4096);
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":0\r\n");
    run(&svc, &[b"SET", b"k", b"v"]);
    svc.shutdown();
    let svc = on(&path, 64 * 4096, 8192);
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":0\r\n");
    svc.shutdown();
    std::fs::remove_file(path).unwrap();
}

/// A node of a cluster starting on the index a clean stop saved serves the keys of its
/// own slots, and keeps the rest unserved (a request for one is sent to its node) until
/// their node takes them: here a node that never answers, so they stay, over a restart
/// too.
#[test]
fn a_node_keeps_the_saved_keys_of_other_slots_for_their_node() {
    let (svc, path) = service("cluster-restart", 256 * 4096, 4096);
    let keys: Vec<String> = (0..100).map(|i| format!("key:{i}")).collect();
    for k in &keys {
        run(&svc, &[b"SET", k.as_bytes(), &[1u8; 5000]]);
    }
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    let me: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
    let mine: Vec<&String> = (keys.iter())
        .filter(|k| cluster::slot(k.as_bytes()) < cluster::SLOTS / 2)
        .collect();
    assert!((30..70).contains(&mine.len()), "{}", mine.len());
    for _restart in 0..2 {
        let svc = in_cluster(&path, 256 * 4096, 4096, 0, vec![me, nobody]);
        assert_eq!(svc.restored_keys, keys.len() as u64);
        for k in &keys {
            let reply = run(&svc, &[b"EXISTS", k.as_bytes()]);
            let expected = match mine.contains(&k) {
                true => ":1\r\n".to_owned(),
                false => format!("-MOVED {} 127.0.0.1:1", cluster::slot(k.as_bytes())),
            };
            assert!(reply.starts_with(expected.as_bytes()), "{k}");
        }
        // Two blocks a value, every value still held.
        assert_eq!(svc.gauges().used_bytes, keys.len() as u64 * 2 * 4096);
        assert_eq!(svc.counters.handed_off.load(Relaxed), 0);
        let theirs = (keys.len() - mine.len()) as u64;
        assert_eq!(svc.counters.handoffs.waiting(), theirs);
        svc.stop.store(true, Relaxed);
        svc.shutdown();
    }
    std::fs::remove_file(path).unwrap();
}

/// A service on the file at `path` that saves checkpoints, though not on its own
/// within a test (every hour): the test takes them.
fn checkpointing(path: &std::path::Path) -> Arc<KvService> {
    checkpointing_blocks(path, 64)
}

/// A service over a file of `blocks` blocks of 4 KiB that saves its index only when
/// told.
fn checkpointing_blocks(path: &std::path::Path, blocks: u64) -> Arc<KvService> {
    let config = KvCache {
        listen: "127.0.0.1:0".parse().unwrap(),
        targets: vec![StorageTarget::Local {
            path: path.to_owned(),
        }],
        capacity: blocks * 4096,
        block_size: 4096,
        stripe: 1 << 20,
        connections: 2,
        inline_max: 16,
        checkpoint: Some(Duration::from_secs(3600)),
        nvme_digests: Default::default(),
        page_cache: None,
        discard: false,
        io_timeout: Duration::from_secs(30),
        max_clients: crate::ir::DEFAULT_MAX_CLIENTS,
        slowlog: Some(crate::ir::DEFAULT_SLOWLOG),
        password_file: None,
        tls: None,
        cluster: Vec::new(),
        cluster_leaving: false,
    };
    KvService::start("kvcache", &config, Arc::new(AtomicBool::new(false))).unwrap()
}

/// A service of `capacity` bytes over the files `paths`, striped in that order in
/// stripes of 64 KiB (blocks of 4 KiB), its index saved when told and at a clean stop,
/// freed blocks discarded.
fn striped(paths: &[std::path::PathBuf], capacity: u64) -> Arc<KvService> {
    let config = KvCache {
        capacity,
        ..striped_config(paths)
    };
    KvService::start("kvcache", &config, Arc::new(AtomicBool::new(false))).unwrap()
}

/// The configuration [`striped`] starts with, for 4 MiB.
fn striped_config(paths: &[std::path::PathBuf]) -> KvCache {
    KvCache {
        listen: "127.0.0.1:0".parse().unwrap(),
        targets: paths
            .iter()
            .map(|p| StorageTarget::Local { path: p.clone() })
            .collect(),
        capacity: 4 << 20,
        block_size: 4096,
        stripe: 65536,
        connections: 2,
        inline_max: 0,
        checkpoint: Some(Duration::from_secs(3600)),
        nvme_digests: Default::default(),
        page_cache: None,
        discard: true,
        io_timeout: Duration::from_secs(30),
        max_clients: crate::ir::DEFAULT_MAX_CLIENTS,
        slowlog: Some(crate::ir::DEFAULT_SLOWLOG),
        password_file: None,
        tls: None,
        cluster: Vec::new(),
        cluster_leaving: false,
    }
}

/// The blocks a clean stop saved the index in stay taken while the process ends: a last
/// round of the discard of freed blocks (`discard on`, no checkpoints: nothing held
/// back), which may come after the save, leaves the saved index whole.
#[test]
fn a_discard_after_the_stop_leaves_the_saved_index_whole() {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-stop-discard", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = KvCache {
        checkpoint: None,
        ..striped_config(std::slice::from_ref(&path))
    };
    let start = || KvService::start("kvcache", &config, Arc::new(AtomicBool::new(false))).unwrap();
    let svc = start();
    run(&svc, &[b"SET", b"kept", &[5u8; 20_000]]);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    let runs = svc.lock().take_undiscarded();
    let block = svc.config.block_size;
    let ranges: Vec<(u64, u64)> = runs.iter().map(|&(b, n)| (b * block, n * block)).collect();
    svc.pool.with(|t| t.discard(&ranges)).unwrap();
    drop(svc);
    let svc = start();
    assert_eq!(svc.restored_keys, 1);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    drop(svc);
    std::fs::remove_file(path).unwrap();
}

/// A store striped over two files: values larger than a stripe are spread over both,
/// and the index comes back only in the same targets, in the same order.
#[test]
fn a_store_striped_over_two_files_comes_back_only_as_it_was() {
    let dir = std::env::temp_dir();
    let paths: Vec<_> = ["a", "b"]
        .iter()
        .map(|n| dir.join(format!("dpuflow-kv-{}-striped-{n}", std::process::id())))
        .collect();
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    let svc = striped(&paths, 4 << 20);
    // Each file holds half the store.
    for p in &paths {
        assert_eq!(std::fs::metadata(p).unwrap().len(), 2 << 20);
    }
    let values: Vec<Vec<u8>> = (0..6u32)
        .map(|i| (0..300_000u32).map(|j| ((i * 7 + j) % 251) as u8).collect())
        .collect();
    for (i, v) in values.iter().enumerate() {
        run(&svc, &[b"SET", format!("k{i}").as_bytes(), v]);
    }
    let held: Vec<Vec<u8>> = paths.iter().map(|p| std::fs::read(p).unwrap()).collect();
    let has = |disk: &[u8], v: &[u8]| disk.windows(4096).any(|w| w == &v[65536..69632]);
    // A value's bytes a stripe in are on one file; across values, on both.
    assert!(values.iter().any(|v| has(&held[0], v)));
    assert!(values.iter().any(|v| has(&held[1], v)));
    let reply = |v: &[u8]| {
        let mut r = Vec::new();
        reply::bulk(&mut r, v);
        r
    };
    for (i, v) in values.iter().enumerate() {
        assert!(run(&svc, &[b"GET", format!("k{i}").as_bytes()]) == reply(v));
    }
    run(&svc, &[b"DEL", b"k0"]);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    drop(svc);
    // The same targets in the same order: every value back.
    let svc = striped(&paths, 4 << 20);
    assert_eq!(svc.restored_keys, 5);
    for (i, v) in values.iter().enumerate().skip(1) {
        assert!(run(&svc, &[b"GET", format!("k{i}").as_bytes()]) == reply(v));
    }
    assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    drop(svc);
    // In the other order, the first target holds no superblock; alone, its superblock
    // is of a store over two: empty either way, no value read from the wrong place.
    let reordered = [paths[1].clone(), paths[0].clone()];
    let svc = striped(&reordered, 4 << 20);
    assert_eq!(svc.restored_keys, 0);
    assert_eq!(run(&svc, &[b"GET", b"k1"]), b"$-1\r\n");
    crash(svc);
    let config = KvCache {
        targets: vec![StorageTarget::Local {
            path: paths[0].clone(),
        }],
        capacity: 2 << 20,
        ..striped_config(&paths)
    };
    match inspect(&config).unwrap().index {
        Err(persist::Unusable::OtherStore { saved }) => {
            assert_eq!((saved.targets, saved.stripe_blocks), (2, 16))
        }
        other => panic!("{other:?}"),
    }
    for p in &paths {
        std::fs::remove_file(p).unwrap();
    }
}

/// A striped store whose second target is replaced by another store's: the values on
/// it go at the start, the others stay, none is read from the wrong drive.
#[test]
fn a_replaced_target_loses_its_values_at_the_start() {
    let dir = std::env::temp_dir();
    let paths: Vec<_> = ["a", "b", "c", "d"]
        .iter()
        .map(|n| dir.join(format!("dpuflow-kv-{}-replaced-{n}", std::process::id())))
        .collect();
    for p in &paths {
        let _ = std::fs::remove_file(p);
    }
    // Values of 10 kB (three blocks), five to a stripe of 16 blocks: some on each
    // target. 36 of them fill blocks 1 to 108, so the saved index (its superblock
    // names its blocks) goes to block 109, on the first target: were it on the
    // replaced one, it would fail its checksum and the start be empty.
    let value = |store: u32, i: u32| -> Vec<u8> {
        (0..10_000u32)
            .map(|j| ((store * 31 + i * 7 + j) % 251) as u8)
            .collect()
    };
    for (store, pair) in [(0, &paths[..2]), (1, &paths[2..])] {
        let svc = striped(pair, 4 << 20);
        for i in 0..36 {
            run(
                &svc,
                &[b"SET", format!("k{i}").as_bytes(), &value(store, i)],
            );
        }
        svc.stop.store(true, Relaxed);
        svc.shutdown();
    }
    // The first store's first target with the second store's second: `kv inspect`
    // tells, then the start drops the values on it.
    let swapped = striped_config(&[paths[0].clone(), paths[3].clone()]);
    let inspected = inspect(&swapped).unwrap();
    let strangers = inspected.strangers.expect("the replaced target found");
    assert_eq!(strangers.targets, [storage::describe(&swapped.targets[1])]);
    let svc = striped(&[paths[0].clone(), paths[3].clone()], 4 << 20);
    let first = std::fs::read(&paths[0]).unwrap();
    assert!(svc.restored_keys > 0, "the saved index is read");
    let mut kept = 0;
    for i in 0..36 {
        let v = value(0, i);
        let got = run(&svc, &[b"GET", format!("k{i}").as_bytes()]);
        if first.windows(v.len()).any(|w| w == v) {
            let mut expect = Vec::new();
            reply::bulk(&mut expect, &v);
            assert!(got == expect, "k{i}, wholly on the first target, is kept");
            kept += 1;
        } else {
            assert_eq!(got, b"$-1\r\n", "k{i}, on the replaced target, is dropped");
        }
    }
    assert!(kept > 0 && kept < 36, "{kept}");
    assert_eq!(svc.restored_keys, kept);
    assert_eq!(strangers.values as u64, 36 - kept);
    assert_eq!(inspected.index.unwrap().keys, kept);
    assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    for p in &paths {
        std::fs::remove_file(p).unwrap();
    }
}

/// A service that ends without a clean stop.
fn crash(svc: Arc<KvService>) {
    svc.stop.store(true, Relaxed);
    drop(svc);
}

/// However many values a full store took since its last checkpoint before it went
/// quiet, the next checkpoint finds room: values take the free blocks first and leave
/// the room kept for it in the blocks held back, which only the save before names.
#[test]
fn a_full_store_that_goes_quiet_still_checkpoints() {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-quiet", std::process::id()));
    let value = [7u8; 4096];
    for writes in 0..24 {
        let _ = std::fs::remove_file(&path);
        let svc = checkpointing_blocks(&path, 32);
        for i in 0..40 {
            run(&svc, &[b"SET", format!("k{i}").as_bytes(), &value]);
        }
        assert!(svc.checkpoint().unwrap());
        for i in 0..writes {
            run(&svc, &[b"SET", format!("w{i}").as_bytes(), &value]);
        }
        let overruns = svc.lock().stats().hold_back_overruns;
        assert!(
            svc.checkpoint().is_ok(),
            "after {writes} writes: {:?}",
            svc.checkpoint()
        );
        // Durable: nothing the one before names was put at risk.
        assert_eq!(svc.lock().stats().hold_back_overruns, overruns);
        let keys = run(&svc, &[b"DBSIZE"]);
        crash(svc);
        let svc = checkpointing_blocks(&path, 32);
        assert_eq!(run(&svc, &[b"DBSIZE"]), keys, "after {writes} writes");
        for i in 0..writes {
            let got = run(&svc, &[b"GET", format!("w{i}").as_bytes()]);
            assert!(
                got.ends_with(&[7, 7, b'\r', b'\n']),
                "w{i} after {writes} writes"
            );
        }
        assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
        svc.shutdown();
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn a_checkpoint_survives_a_crash_as_it_was_taken() {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-ckpt", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let svc = checkpointing(&path);
    let big: Vec<u8> = (0..50_000u32).map(|i| (i % 251) as u8).collect();
    let mut big_reply = Vec::new();
    reply::bulk(&mut big_reply, &big);
    run(&svc, &[b"SET", b"big", &big]);
    // Kept in memory only, until the checkpoint writes it.
    run(&svc, &[b"SET", b"small", b"x"]);
    run(
        &svc,
        &[b"SET", b"deadline", b"d", b"PXAT", b"4000000000000"],
    );
    assert_eq!(run(&svc, &[b"LASTSAVE"]), b":0\r\n");
    assert_eq!(run(&svc, &[b"SAVE"]), b"+OK\r\n");
    assert!(!svc.checkpoint().unwrap(), "nothing changed since");
    let info = svc.info();
    assert!(
        info.contains("\r\n# Persistence\r\nloading:0\r\nrdb_changes_since_last_save:0\r\n"),
        "{info}"
    );
    assert!(info.contains("rdb_bgsave_in_progress:0\r\n"), "{info}");
    assert!(info.contains("rdb_last_bgsave_status:ok\r\n"), "{info}");
    // What `redis-cli --stat` reads.
    for field in [
        "\r\nblocked_clients:0\r\n",
        "\r\nused_memory:",
        "\r\ntotal_connections_received:0\r\n",
        "\r\ntotal_commands_processed:",
    ] {
        assert!(info.contains(field), "{field:?} in {info}");
    }
    let lastsave = String::from_utf8(run(&svc, &[b"LASTSAVE"])).unwrap();
    let at: i64 = lastsave.trim_start_matches(':').trim_end().parse().unwrap();
    assert!((now_ms() / 1000 - at).abs() < 60, "{lastsave}");
    // After it: `big` deleted and its blocks wanted by new values, `small` written
    // again.
    run(&svc, &[b"DEL", b"big"]);
    for k in [&b"after1"[..], b"after2"] {
        run(&svc, &[b"SET", k, &[9u8; 50_000]]);
    }
    run(&svc, &[b"SET", b"small", b"y"]);
    assert!(svc.info().contains("rdb_changes_since_last_save:4\r\n"));
    crash(svc);
    // Twice: a start keeps the checkpoint it loaded until it takes one of its own.
    for round in 0..2 {
        let svc = checkpointing(&path);
        assert_eq!(svc.restored_keys, 3, "round {round}");
        let back = run(&svc, &[b"GET", b"big"]);
        assert!(
            back == big_reply,
            "round {round}: {:?}",
            &back[..back.len().min(16)]
        );
        assert_eq!(run(&svc, &[b"GET", b"small"]), b"$1\r\nx\r\n");
        assert_eq!(
            run(&svc, &[b"PEXPIRETIME", b"deadline"]),
            b":4000000000000\r\n"
        );
        assert_eq!(run(&svc, &[b"EXISTS", b"after1", b"after2"]), b":0\r\n");
        run(&svc, &[b"DEL", b"big"]);
        run(&svc, &[b"SET", b"later", &[7u8; 60_000]]);
        assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
        crash(svc);
    }
    // A checkpoint of its own replaces it; a clean stop replaces that.
    let svc = checkpointing(&path);
    run(&svc, &[b"DEL", b"big"]);
    assert!(svc.checkpoint().unwrap());
    run(&svc, &[b"SET", b"last", b"z"]);
    crash(svc);
    let svc = checkpointing(&path);
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":2\r\n");
    run(&svc, &[b"SET", b"last", b"z"]);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    let svc = checkpointing(&path);
    assert_eq!(run(&svc, &[b"GET", b"last"]), b"$1\r\nz\r\n");
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":3\r\n");
    crash(svc);
    std::fs::remove_file(path).unwrap();
}

/// A checkpoint of more keys than it copies under one lock, while another client
/// writes, reads and deletes them: after a crash every key is back with a value it had,
/// and none reads corrupt.
#[test]
fn a_checkpoint_copied_in_parts_while_keys_change_restores() {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-parts", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let keys = 3 * SNAPSHOT_PART as u32;
    let svc = checkpointing_blocks(&path, 4 * u64::from(keys));
    for i in 0..keys {
        run(&svc, &[b"SET", format!("k{i}").as_bytes(), b"before"]);
    }
    let done = AtomicBool::new(false);
    let changed = std::thread::scope(|s| {
        let client = s.spawn(|| {
            let mut n = 0u32;
            while !done.load(Relaxed) {
                let k = format!("k{}", n.wrapping_mul(2_654_435_761) % keys);
                match n % 3 {
                    0 => run(&svc, &[b"SET", k.as_bytes(), b"during"]),
                    1 => run(&svc, &[b"GET", k.as_bytes()]),
                    _ => run(&svc, &[b"SET", format!("new{n}").as_bytes(), b"during"]),
                };
                n += 1;
            }
            n
        });
        assert!(svc.checkpoint().unwrap());
        done.store(true, Relaxed);
        client.join().unwrap()
    });
    assert!(changed > 0);
    let saved = svc.lock().stats().keys;
    crash(svc);
    let svc = checkpointing_blocks(&path, 4 * u64::from(keys));
    // Keys the client added after the copy ended wait for the next checkpoint.
    assert!(svc.restored_keys >= u64::from(keys) && svc.restored_keys <= saved);
    for i in 0..keys {
        let value = run(&svc, &[b"GET", format!("k{i}").as_bytes()]);
        assert!(
            value == b"$6\r\nbefore\r\n" || value == b"$6\r\nduring\r\n",
            "k{i}: {value:?}"
        );
    }
    assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
    crash(svc);
    std::fs::remove_file(path).unwrap();
}

/// Between whole snapshots a checkpoint saves the keys changed since the last as a
/// delta, far smaller; a crash restores the snapshot and its deltas in order, the
/// first checkpoint after it is a delta on them, and one after most keys changed is
/// whole.
#[test]
fn checkpoints_between_snapshots_save_the_keys_changed() {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-delta", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let svc = checkpointing_blocks(&path, 4096);
    let big = |tag: &str| format!("{tag}-{}", "x".repeat(100)).into_bytes();
    for i in 0..1000 {
        // Every other value kept in memory too, written by the checkpoint.
        let value = if i % 2 == 0 {
            b"small".to_vec()
        } else {
            big("before")
        };
        run(&svc, &[b"SET", format!("k{i}").as_bytes(), &value]);
    }
    let deltas = |svc: &KvService| svc.counters.checkpoint_deltas.load(Relaxed);
    let written = |svc: &KvService| svc.counters.checkpoint_bytes.load(Relaxed);
    assert!(svc.checkpoint().unwrap());
    let whole = written(&svc);
    assert_eq!(deltas(&svc), 0);
    run(&svc, &[b"SET", b"k0", b"tiny"]);
    run(&svc, &[b"SET", b"k1", &big("after")]);
    run(&svc, &[b"DEL", b"k3"]);
    run(&svc, &[b"SET", b"new", &big("new")]);
    run(&svc, &[b"EXPIRE", b"k5", b"10000"]);
    assert!(svc.checkpoint().unwrap());
    assert_eq!(deltas(&svc), 1);
    assert!(
        written(&svc) - whole <= whole / 8,
        "{} after {whole}",
        written(&svc)
    );
    run(&svc, &[b"GET", b"k7"]);
    assert!(!svc.checkpoint().unwrap(), "a read changes nothing to save");
    run(&svc, &[b"SET", b"k3", b"back"]);
    assert!(svc.checkpoint().unwrap());
    assert_eq!(deltas(&svc), 2);
    crash(svc);
    let svc = checkpointing_blocks(&path, 4096);
    assert_eq!(svc.restored_keys, 1001);
    let get = |svc: &KvService, k: &str| run(svc, &[b"GET", k.as_bytes()]);
    let bulk = |v: &[u8]| {
        let mut r = Vec::new();
        reply::bulk(&mut r, v);
        r
    };
    assert_eq!(get(&svc, "k0"), bulk(b"tiny"));
    assert_eq!(get(&svc, "k1"), bulk(&big("after")));
    assert_eq!(get(&svc, "k3"), bulk(b"back"));
    assert_eq!(get(&svc, "new"), bulk(&big("new")));
    assert_eq!(get(&svc, "k2"), bulk(b"small"));
    assert_eq!(get(&svc, "k999"), bulk(&big("before")));
    let ttl = String::from_utf8(run(&svc, &[b"TTL", b"k5"])).unwrap();
    assert!(ttl.starts_with(':') && ttl != ":-1\r\n", "{ttl}");
    assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
    // After a start, the first checkpoint is a delta on the save restored too.
    run(&svc, &[b"SET", b"k2", b"again"]);
    assert!(svc.checkpoint().unwrap());
    assert_eq!(deltas(&svc), 1);
    assert!(
        written(&svc) <= whole / 8,
        "{} after {whole}",
        written(&svc)
    );
    run(&svc, &[b"SET", b"k4", b"and again"]);
    assert!(svc.checkpoint().unwrap());
    assert_eq!(deltas(&svc), 2);
    crash(svc);
    let svc = checkpointing_blocks(&path, 4096);
    assert_eq!(get(&svc, "k2"), bulk(b"again"));
    assert_eq!(get(&svc, "k4"), bulk(b"and again"));
    assert_eq!(get(&svc, "k1"), bulk(&big("after")));
    // After most keys changed, a checkpoint is whole.
    for i in 0..700 {
        run(&svc, &[b"SET", format!("k{i}").as_bytes(), b"most"]);
    }
    assert!(svc.checkpoint().unwrap());
    assert_eq!(deltas(&svc), 0);
    crash(svc);
    let svc = checkpointing_blocks(&path, 4096);
    assert_eq!(get(&svc, "k699"), bulk(b"most"));
    assert_eq!(get(&svc, "k700"), bulk(b"small"));
    crash(svc);
    std::fs::remove_file(path).unwrap();
}

/// A connection's start, as a client from nowhere in particular.
fn session(svc: &KvService) -> Session {
    let nowhere = SocketAddr::from(([127, 0, 0, 1], 0));
    Session {
        proto: Proto::Resp2,
        authed: svc.password.is_none(),
        monitoring: None,
        client: svc.clients.register(nowhere, nowhere, -1),
        transaction: None,
        watched: Vec::new(),
    }
}

/// The reply to `words`, as it is sent to a client that sends them.
fn run(svc: &KvService, words: &[&[u8]]) -> Vec<u8> {
    run_pipelined(svc, &[words])
}

/// The replies to `requests` (each its words), as they are sent to a client that sends
/// them all at once.
fn run_pipelined(svc: &KvService, requests: &[&[&[u8]]]) -> Vec<u8> {
    let mut sent = Vec::new();
    for words in requests {
        reply::array(&mut sent, words.len());
        for w in *words {
            reply::bulk(&mut sent, w);
        }
    }
    let mut client = Scripted {
        pieces: [sent].into(),
        written: Vec::new(),
    };
    svc.talk(&mut client, session(svc)).expect("talk");
    client.written
}

#[test]
fn values_round_trip_through_the_target() {
    let (svc, path) = service("round_trip", 1 << 20, 4096);
    let big: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(run(&svc, &[b"SET", b"k", &big]), b"+OK\r\n");
    let mut expect = format!("${}\r\n", big.len()).into_bytes();
    expect.extend_from_slice(&big);
    expect.extend_from_slice(b"\r\n");
    assert_eq!(run(&svc, &[b"get", b"k"]), expect);
    // The bytes are on the target, from block 1 (block 0 is the superblock's).
    let disk = std::fs::read(&path).unwrap();
    assert_eq!(&disk[4096..4096 + big.len()], &big[..]);
    assert_eq!(run(&svc, &[b"GET", b"nope"]), b"$-1\r\n");
    assert_eq!(run(&svc, &[b"STRLEN", b"k"]), b":10000\r\n");
    assert_eq!(run(&svc, &[b"EXISTS", b"k", b"nope", b"k"]), b":2\r\n");
    assert_eq!(run(&svc, &[b"SET", b"k", b"x", b"NX"]), b"$-1\r\n");
    assert_eq!(run(&svc, &[b"SET", b"j", b"x", b"XX"]), b"$-1\r\n");
    assert_eq!(run(&svc, &[b"MSET", b"a", b"1", b"b", b""]), b"+OK\r\n");
    assert_eq!(
        run(&svc, &[b"MGET", b"a", b"zz", b"b"]),
        b"*3\r\n$1\r\n1\r\n$-1\r\n$0\r\n\r\n"
    );
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":3\r\n");
    assert_eq!(run(&svc, &[b"DEL", b"a", b"b", b"zz"]), b":2\r\n");
    assert_eq!(run(&svc, &[b"FLUSHALL"]), b"+OK\r\n");
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":0\r\n");
    std::fs::remove_file(path).unwrap();
}

/// The bulk strings of a reply, in order.
fn bulks(out: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(out);
    let lines: Vec<&str> = text.split("\r\n").collect();
    lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with('$'))
        .map(|(i, _)| lines[i + 1].to_owned())
        .collect()
}

#[test]
fn scan_visits_every_key_once_and_keys_matches_patterns() {
    let (svc, path) = service("scan", 1 << 20, 512);
    for i in 0..40 {
        run(&svc, &[b"SET", format!("layer{i}:kv").as_bytes(), b"x"]);
    }
    run(&svc, &[b"SET", b"meta", b"y"]);
    let mut keys = bulks(&run(&svc, &[b"KEYS", b"layer*:kv"]));
    keys.sort();
    assert_eq!(keys.len(), 40);
    assert_eq!(bulks(&run(&svc, &[b"KEYS", b"m?ta"])), ["meta"]);
    let mut seen = Vec::new();
    let mut cursor = "0".to_owned();
    let mut calls = 0;
    loop {
        let out = run(
            &svc,
            &[
                b"SCAN",
                cursor.as_bytes(),
                b"COUNT",
                b"7",
                b"MATCH",
                b"layer*",
            ],
        );
        let mut got = bulks(&out);
        cursor = got.remove(0);
        seen.extend(got);
        calls += 1;
        // Keys come and go meanwhile; those held throughout are seen once.
        run(&svc, &[b"SET", format!("new{calls}").as_bytes(), b"z"]);
        run(&svc, &[b"DEL", b"meta"]);
        if cursor == "0" {
            break;
        }
    }
    seen.sort();
    assert_eq!(seen, keys, "every layer key once");
    assert!(calls >= 6, "{calls} calls of 7 keys");
    // Every value is a string: no key is of another type.
    let hashes = bulks(&run(
        &svc,
        &[b"SCAN", b"0", b"COUNT", b"1000", b"TYPE", b"hash"],
    ));
    assert_eq!(hashes, ["0"]);
    assert!(run(&svc, &[b"SCAN", b"x"]).starts_with(b"-ERR invalid cursor"));
    std::fs::remove_file(path).unwrap();
}

/// Of clients racing to `SET … NX` one key, one stores it; `XX` stores only over a
/// value, its own included when that value made room for the new one.
#[test]
fn set_nx_and_xx_hold_under_races_and_full_stores() {
    let (svc, path) = service("nx", 8 * 4096, 4096);
    for round in 0..20 {
        let key = format!("k{round}");
        let start = Arc::new(std::sync::Barrier::new(8));
        let racers: Vec<_> = (0..8)
            .map(|t| {
                let (svc, key, start) = (Arc::clone(&svc), key.clone(), Arc::clone(&start));
                std::thread::spawn(move || {
                    let mut out = Replies::with_capacity(0);
                    start.wait();
                    svc.execute(
                        &[b"SET", key.as_bytes(), &[t; 3000], b"NX"],
                        &mut out,
                        &mut session(&svc),
                    );
                    usize::from(out.pending() == b"+OK\r\n")
                })
            })
            .collect();
        let winners: usize = racers.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(winners, 1, "round {round}");
    }
    // A full store: 7 blocks for values, a 4-block value overwritten by XX with
    // another, which needs the old one's blocks.
    run(&svc, &[b"FLUSHALL"]);
    assert_eq!(
        run(&svc, &[b"SET", b"big", &[1; 4 * 4096], b"XX"]),
        b"$-1\r\n"
    );
    run(&svc, &[b"SET", b"big", &[1; 4 * 4096]]);
    run(&svc, &[b"SET", b"other", &[2; 3 * 4096]]);
    assert_eq!(
        run(&svc, &[b"SET", b"big", &[3; 4 * 4096], b"XX"]),
        b"+OK\r\n"
    );
    assert_eq!(run(&svc, &[b"STRLEN", b"big"]), b":16384\r\n");
    std::fs::remove_file(path).unwrap();
}

#[test]
fn keys_expire_at_their_deadline() {
    let (svc, path) = service("expiry", 8 * 4096, 4096);
    assert_eq!(run(&svc, &[b"SET", b"k", b"v", b"PX", b"150"]), b"+OK\r\n");
    assert_eq!(run(&svc, &[b"PERSIST", b"k"]), b":1\r\n");
    assert_eq!(run(&svc, &[b"TTL", b"k"]), b":-1\r\n");
    assert_eq!(run(&svc, &[b"PEXPIRE", b"k", b"150"]), b":1\r\n");
    assert_eq!(run(&svc, &[b"SET", b"p", b"v"]), b"+OK\r\n");
    assert_eq!(run(&svc, &[b"EXISTS", b"k", b"p"]), b":2\r\n");
    std::thread::sleep(Duration::from_millis(300));
    // Gone for every command, its block free again, and counted.
    assert_eq!(run(&svc, &[b"GET", b"k"]), b"$-1\r\n");
    assert_eq!(run(&svc, &[b"TTL", b"k"]), b":-2\r\n");
    assert_eq!(run(&svc, &[b"DBSIZE"]), b":1\r\n");
    let g = svc.gauges();
    assert_eq!((g.keys, g.expiring, g.expired), (1, 0, 1));
    assert_eq!(g.used_bytes, 4096);
    std::fs::remove_file(path).unwrap();
}

/// Keys given one deadline pass it together, more of them than a command removes: they
/// are gone to every command all the same, and removed a batch a command.
#[test]
fn many_keys_expiring_together_are_gone_before_they_are_removed() {
    let n = PURGED_AT_ONCE * 4;
    let (svc, path) = service("mass-expiry", (n as u64 + 64) * 512, 512);
    let at = now_ms() + 1500;
    for i in 0..n {
        let key = format!("k{i}");
        let at = at.to_string();
        run(
            &svc,
            &[b"SET", key.as_bytes(), b"v", b"PXAT", at.as_bytes()],
        );
    }
    run(&svc, &[b"SET", b"live", b"v"]);
    std::thread::sleep(Duration::from_millis(
        u64::try_from(at + 100 - now_ms()).unwrap_or(0),
    ));
    // Keys of one deadline go in key order: "k999" is among the last.
    assert_eq!(run(&svc, &[b"GET", b"k999"]), b"$-1\r\n");
    assert_eq!(run(&svc, &[b"EXISTS", b"k999", b"k0", b"live"]), b":1\r\n");
    assert_eq!(run(&svc, &[b"TTL", b"k998"]), b":-2\r\n");
    assert_eq!(bulks(&run(&svc, &[b"KEYS", b"*"])), ["live"]);
    let g = svc.gauges();
    assert_eq!((g.keys, g.expiring, g.expired), (1, 0, n as u64));
    std::fs::remove_file(path).unwrap();
}

#[test]
fn set_keeps_or_clears_the_deadline() {
    let (svc, path) = service("keepttl", 8 * 4096, 4096);
    run(&svc, &[b"SET", b"k", b"v", b"EX", b"100"]);
    run(&svc, &[b"SET", b"k", b"w", b"KEEPTTL"]);
    assert_eq!(run(&svc, &[b"TTL", b"k"]), b":100\r\n");
    run(&svc, &[b"SET", b"k", b"x"]);
    assert_eq!(run(&svc, &[b"TTL", b"k"]), b":-1\r\n");
    // A deadline already past stores nothing and takes the key away.
    assert_eq!(
        run(&svc, &[b"SET", b"k", b"y", b"PXAT", b"1000"]),
        b"+OK\r\n"
    );
    assert_eq!(run(&svc, &[b"EXISTS", b"k"]), b":0\r\n");
    for bad in [
        &[&b"EX"[..], b"1", b"PX", b"1"][..],
        &[b"KEEPTTL", b"EX", b"1"],
        &[b"NX", b"XX"],
    ] {
        let mut args: Vec<&[u8]> = vec![b"SET", b"k", b"v"];
        args.extend_from_slice(bad);
        assert_eq!(run(&svc, &args), b"-ERR syntax error\r\n", "{bad:?}");
    }
    assert_eq!(
        run(&svc, &[b"SET", b"k", b"v", b"EX", b"01"]),
        b"-ERR value is not an integer or out of range\r\n"
    );
    std::fs::remove_file(path).unwrap();
}

/// `COMMAND COUNT` counts the commands served: each of them is, and others are unknown.
#[test]
fn the_commands_counted_are_the_commands_served() {
    assert!(SERVED.is_sorted(), "SERVED is searched");
    let (svc, path) = service("served", 1 << 20, 4096);
    let unknown = |name: &str| {
        let reply = run(&svc, &[name.as_bytes()]);
        String::from_utf8_lossy(&reply).starts_with("-ERR unknown command")
    };
    for name in SERVED {
        assert!(!unknown(name), "{name}");
        assert!(!unknown(&name.to_ascii_uppercase()), "{name}");
    }
    for name in [
        "hset",
        "incr",
        "lpush",
        "append",
        "psubscribe",
        "subscribe",
        "shutdown",
    ] {
        assert!(unknown(name), "{name}");
    }
    let count = format!(":{}\r\n", SERVED.len());
    assert_eq!(run(&svc, &[b"COMMAND", b"COUNT"]), count.as_bytes());
    // `COMMAND INFO`'s arity of each is the one requests are held to: one word short of
    // it, and one past an exact arity, is the wrong number of arguments.
    for c in &catalog::CATALOG {
        let words = c.arity.unsigned_abs() as usize;
        let container = !catalog::subcommands_of(c.name).is_empty();
        let mut wrong = Vec::new();
        if words >= 2 && !container {
            wrong.push(words - 1);
        }
        if c.arity > 0 {
            wrong.push(words + 1);
        }
        for n in wrong {
            let mut request = vec![c.name.as_bytes()];
            request.extend(std::iter::repeat_n(&b"1"[..], n - 1));
            let reply = String::from_utf8_lossy(&run(&svc, &request)).into_owned();
            let e = format!("wrong number of arguments for '{}' command", c.name);
            // As Redis: an EXEC refused ends the transaction, whether or not one began.
            let expected = match c.name {
                "exec" => format!("-EXECABORT Transaction discarded because of: {e}"),
                _ => format!("-ERR {e}"),
            };
            assert!(
                reply.starts_with(&expected),
                "{} in {n} words: {reply}",
                c.name
            );
        }
    }
    assert!(
        (catalog::SUBCOMMANDS.iter()).is_sorted_by_key(|s| s.name),
        "a command's subcommands are found together"
    );
    // Each subcommand listed is served, with as few arguments as it takes, and none past
    // its most; what CLIENT LIST names it by is its name.
    let mut s = session(&svc);
    for (i, c) in catalog::SUBCOMMANDS.iter().enumerate() {
        let (name, least, most) = (c.name, c.least, c.most);
        let (command, sub) = name.split_once('|').expect("command|sub");
        let mut words = vec![command.as_bytes(), sub.as_bytes()];
        words.extend(std::iter::repeat_n(&b"0"[..], least));
        let mut out = Replies::with_capacity(0);
        svc.execute(&words, &mut out, &mut s);
        let reply = String::from_utf8_lossy(out.pending()).into_owned();
        assert!(
            !reply.contains("unknown subcommand") && !reply.contains("wrong number"),
            "{name}: {reply}"
        );
        assert!(
            s.client.line().contains(&format!(" cmd={name} ")),
            "{i} {name}"
        );
        if most < usize::MAX {
            words.extend(std::iter::repeat_n(&b"0"[..], most + 1 - least));
            let reply = run(&svc, &words);
            let wrong = format!("-ERR wrong number of arguments for '{name}' command\r\n");
            assert_eq!(String::from_utf8_lossy(&reply), wrong, "{name}");
        }
    }
    // HELP lists each command's subcommands, as Redis lists its own.
    for command in [
        "client", "command", "config", "latency", "memory", "slowlog",
    ] {
        let help = String::from_utf8(run(&svc, &[command.as_bytes(), b"HELP"])).unwrap();
        let upper = command.to_ascii_uppercase();
        let of_it = catalog::SUBCOMMANDS
            .iter()
            .filter(|c| c.name.starts_with(command));
        assert!(
            help.starts_with('*') && help.contains(&format!("+{upper} <subcommand>")),
            "{help}"
        );
        for c in of_it {
            assert!(
                help.contains(&format!("\r\n+{}\r\n+    ", c.usage)),
                "{} in {help}",
                c.name
            );
        }
        assert!(
            help.ends_with("+HELP\r\n+    Prints this help.\r\n"),
            "{help}"
        );
    }
    std::fs::remove_file(path).unwrap();
}

#[test]
fn errors_read_like_redis() {
    let (svc, path) = service("errors", 8192, 4096);
    assert_eq!(
        run(&svc, &[b"GET"]),
        b"-ERR wrong number of arguments for 'get' command\r\n"
    );
    assert_eq!(
        run(&svc, &[b"SET", b"k", b"v", b"EX", b"0"]),
        b"-ERR invalid expire time in 'set' command\r\n"
    );
    assert_eq!(
        run(&svc, &[b"FOO", b"bar"]),
        b"-ERR unknown command 'FOO', with args beginning with: 'bar' \r\n"
    );
    let too_big = vec![0u8; 8193];
    assert!(run(&svc, &[b"SET", b"k", &too_big]).starts_with(b"-ERR the value"));
    assert_eq!(run(&svc, &[b"PING"]), b"+PONG\r\n");
    assert_eq!(
        run(&svc, &[b"CONFIG", b"GET", b"appendonly"]),
        b"*2\r\n$10\r\nappendonly\r\n$2\r\nno\r\n"
    );
    std::fs::remove_file(path).unwrap();
}

/// INFO counts a connection's bytes each way and each command's requests and time, as
/// Redis's `total_net_*_bytes` and commandstats do (what redis_exporter turns into
/// `redis_net_*_bytes_total` and `redis_commands_*`).
#[test]
fn info_counts_bytes_and_requests_by_command() {
    let (svc, path) = service("info-counts", 1 << 20, 4096);
    let requests = b"SET k v\r\n*2\r\n$3\r\nGET\r\n$1\r\nk\r\nGET k\r\nPING\r\nGET\r\nQUIT\r\n";
    let mut c = TcpStream::connect(svc.listen).unwrap();
    c.write_all(requests).unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&back),
        "+OK\r\n$1\r\nv\r\n$1\r\nv\r\n+PONG\r\n\
         -ERR wrong number of arguments for 'get' command\r\n+OK\r\n"
    );
    let info = svc.info();
    for field in [
        format!("\r\ntotal_net_input_bytes:{}\r\n", requests.len()),
        format!("\r\ntotal_net_output_bytes:{}\r\n", back.len()),
        "\r\nrejected_connections:0\r\n".to_owned(),
        "\r\n# Commandstats\r\ncmdstat_get:calls=3,usec=".to_owned(),
        "\r\ncmdstat_set:calls=1,usec=".to_owned(),
        "\r\ncmdstat_ping:calls=1,usec=".to_owned(),
    ] {
        assert!(info.contains(&field), "{field:?} in {info}");
    }
    assert!(info.contains("\r\ncmdstat_quit:calls=1,usec="), "{info}");
    assert_eq!(info.matches("cmdstat_").count(), 4, "{info}");
    let ping = info
        .lines()
        .find(|l| l.starts_with("cmdstat_ping:"))
        .unwrap();
    let field = |name: &str| -> f64 {
        let (_, rest) = ping.split_once(&format!("{name}=")).unwrap();
        rest.split(',').next().unwrap().parse().unwrap()
    };
    assert!(
        (field("usec_per_call") - field("usec")).abs() < 0.01,
        "{ping}"
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn pipelined_requests_over_tcp() {
    let (svc, path) = service("pipelined", 16 << 20, 4096);
    // A value larger than the connection's buffers, twice over (they grow, and are
    // given back).
    let big: Vec<u8> = (0..(6 << 20) as u32).map(|i| (i % 253) as u8).collect();
    let mut c = TcpStream::connect(svc.listen).unwrap();
    for _ in 0..2 {
        let mut req = b"*3\r\n$3\r\nSET\r\n$3\r\nbig\r\n".to_vec();
        reply::bulk(&mut req, &big);
        c.write_all(&req).unwrap();
        let mut ok = [0u8; 5];
        c.read_exact(&mut ok).unwrap();
        assert_eq!(&ok, b"+OK\r\n");
        c.write_all(b"GET big\r\n").unwrap();
        let mut expect = Vec::new();
        reply::bulk(&mut expect, &big);
        let mut back = vec![0u8; expect.len()];
        c.read_exact(&mut back).unwrap();
        assert!(back == expect);
    }
    let mut c = TcpStream::connect(svc.listen).unwrap();
    c.write_all(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\nhi\r\nGET k\r\nPING\r\nQUIT\r\n")
        .unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"+OK\r\n$2\r\nhi\r\n+PONG\r\n+OK\r\n");
    // GETs in a row are answered together, each in its place among the others.
    let mut c = TcpStream::connect(svc.listen).unwrap();
    c.write_all(
        b"GET k\r\nget nope\r\n*2\r\n$3\r\nGeT\r\n$1\r\nk\r\nGET\r\nPING\r\nGET k\r\nQUIT\r\n",
    )
    .unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&back),
        "$2\r\nhi\r\n$-1\r\n$2\r\nhi\r\n-ERR wrong number of arguments for 'get' command\r\n\
         +PONG\r\n$2\r\nhi\r\n+OK\r\n"
    );
    // SETs in a row likewise: a value given twice is the later one, a SET with options
    // or of the wrong arity ends the run and answers as alone.
    let mut c = TcpStream::connect(svc.listen).unwrap();
    c.write_all(
        b"SET a 1\r\nset b 22\r\nSET a 333\r\nSET c 4 NX\r\nSET c 5 NX\r\nSET d\r\n\
          SET d 6\r\nGET a\r\nGET b\r\nGET c\r\nGET d\r\nQUIT\r\n",
    )
    .unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&back),
        "+OK\r\n+OK\r\n+OK\r\n+OK\r\n$-1\r\n\
         -ERR wrong number of arguments for 'set' command\r\n+OK\r\n\
         $3\r\n333\r\n$2\r\n22\r\n$1\r\n4\r\n$1\r\n6\r\n+OK\r\n"
    );
    let mut c = TcpStream::connect(svc.listen).unwrap();
    c.write_all(b"*1\r\n:1\r\n").unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"-ERR Protocol error: expected '$', got ':'\r\n");
    std::fs::remove_file(path).unwrap();
}

/// A client whose bytes arrive in the pieces given; what the service writes is kept.
struct Scripted {
    pieces: std::collections::VecDeque<Vec<u8>>,
    written: Vec<u8>,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(mut piece) = self.pieces.pop_front() else {
            return Ok(0);
        };
        let n = piece.len().min(buf.len());
        buf[..n].copy_from_slice(&piece[..n]);
        if n < piece.len() {
            self.pieces.push_front(piece.split_off(n));
        }
        Ok(n)
    }
}

impl Write for Scripted {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.written.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
    /// SETs and GETs of small and large values, their bytes cut anywhere into pieces
    /// (a GET's reply placed so that its value starts on a cache line): the replies are
    /// those of a map.
    #[test]
    fn requests_cut_anywhere_are_answered_as_a_map_would(
        ops in proptest::collection::vec(
            (proptest::bool::ANY, 0u8..3, proptest::prop_oneof![0usize..100, 60_000usize..200_000]),
            1..8,
        ),
        cuts in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..12),
    ) {
        static CASE: AtomicU64 = AtomicU64::new(0);
        let case = CASE.fetch_add(1, Relaxed);
        let (svc, path) = service(&format!("cut-{case}"), 4 << 20, 4096);
        let (mut sent, mut expect) = (Vec::new(), Vec::new());
        let mut model: std::collections::HashMap<u8, Vec<u8>> = Default::default();
        for (i, &(set, key, len)) in ops.iter().enumerate() {
            let k = [b'k', key];
            if set {
                let value = vec![i as u8; len];
                reply::array(&mut sent, 3);
                for word in [&b"SET"[..], &k, &value] {
                    reply::bulk(&mut sent, word);
                }
                reply::ok(&mut expect);
                model.insert(key, value);
            } else {
                reply::array(&mut sent, 2);
                reply::bulk(&mut sent, b"GET");
                reply::bulk(&mut sent, &k);
                match model.get(&key) {
                    Some(v) => reply::bulk(&mut expect, v),
                    None => reply::null(&mut expect, Proto::Resp2),
                }
            }
        }
        let mut at: Vec<usize> = cuts.iter().map(|c| c.index(sent.len())).collect();
        at.sort_unstable();
        at.dedup();
        let mut pieces = std::collections::VecDeque::new();
        let mut from = 0;
        // An empty read would say the client has gone.
        for to in at.into_iter().chain([sent.len()]).filter(|&to| to > 0) {
            pieces.push_back(sent[from..to].to_vec());
            from = to;
        }
        let mut client = Scripted { pieces, written: Vec::new() };
        svc.talk(&mut client, session(&svc)).unwrap();
        proptest::prop_assert!(client.written == expect);
        std::fs::remove_file(path).unwrap();
    }
}

/// Pipelined SETs whose values arrive in pieces are written in one run: the run waits
/// for a SET that has begun to arrive.
#[test]
fn a_set_arriving_in_pieces_joins_the_run_before_it() {
    let (svc, path) = service("arriving", 1 << 20, 4096);
    let mut c = TcpStream::connect(svc.listen).unwrap();
    let mut first = b"*3\r\n$3\r\nSET\r\n$1\r\na\r\n".to_vec();
    reply::bulk(&mut first, &[1; 10_000]);
    let mut second = b"*3\r\n$3\r\nset\r\n$1\r\nb\r\n".to_vec();
    reply::bulk(&mut second, &[2; 10_000]);
    let (head, tail) = second.split_at(5000);
    c.write_all(&[&first[..], head].concat()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    c.write_all(tail).unwrap();
    let mut ok = [0u8; 10];
    c.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"+OK\r\n+OK\r\n");
    assert_eq!(svc.counters.storage[WRITE].count.load(Relaxed), 1);
    // A request other than SET arriving ends the run at once.
    c.write_all(&[&first[..], b"*2\r\n$3\r\nGET"].concat())
        .unwrap();
    let mut ok = [0u8; 5];
    c.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"+OK\r\n");
    c.write_all(b"\r\n$1\r\nb\r\n").unwrap();
    let mut expect = Vec::new();
    reply::bulk(&mut expect, &[2; 10_000]);
    let mut back = vec![0; expect.len()];
    c.read_exact(&mut back).unwrap();
    assert!(back == expect);
    // A client that stops sending halfway through a SET has those before it served.
    let mut c = TcpStream::connect(svc.listen).unwrap();
    c.write_all(&[&first[..], head].concat()).unwrap();
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut back = Vec::new();
    c.read_to_end(&mut back).unwrap();
    assert_eq!(back, b"+OK\r\n");
    std::fs::remove_file(path).unwrap();
}

/// Pipelined `RESTORE`s (as `MIGRATE` sends them) are answered as they would be one at a
/// time, key restored again in the run, busy key, deadline already past, bad TTL and
/// bad payload included, and their values written in runs: one for the values before a
/// key comes again, one for the rest.
#[test]
fn pipelined_restores_are_answered_as_one_at_a_time_and_written_together() {
    let payload = |byte: u8| crate::kvcache::dump::encode(&[byte; 5000]);
    let (p1, p2, p3, p4, p5) = (payload(1), payload(2), payload(3), payload(4), payload(5));
    let requests: [&[&[u8]]; 8] = [
        &[b"RESTORE", b"a", b"0", &p1],
        &[b"RESTORE", b"b", b"0", &p2],
        &[b"RESTORE", b"a", b"0", &p3],
        &[b"restore", b"a", b"0", &p4, b"REPLACE"],
        &[b"RESTORE", b"c", b"50000", &p5],
        &[b"RESTORE", b"b", b"1", &p1, b"REPLACE", b"ABSTTL"],
        &[b"RESTORE", b"d", b"-1", &p1],
        &[b"RESTORE", b"e", b"0", b"not a payload"],
    ];
    let (one_by_one, path) = service("restore_one_by_one", 1 << 20, 4096);
    let expect: Vec<u8> = requests.iter().flat_map(|r| run(&one_by_one, r)).collect();
    assert_eq!(one_by_one.counters.storage[WRITE].count.load(Relaxed), 4);
    let (pipelined, other_path) = service("restore_pipelined", 1 << 20, 4096);
    let written = run_pipelined(&pipelined, &requests);
    assert_eq!(
        String::from_utf8_lossy(&written),
        String::from_utf8_lossy(&expect)
    );
    assert!(expect.starts_with(b"+OK\r\n+OK\r\n-BUSYKEY"), "{expect:?}");
    assert_eq!(pipelined.counters.storage[WRITE].count.load(Relaxed), 2);
    for svc in [&one_by_one, &pipelined] {
        let mut value = b"$5000\r\n".to_vec();
        value.extend_from_slice(&[4; 5000]);
        value.extend_from_slice(b"\r\n");
        assert_eq!(run(svc, &[b"GET", b"a"]), value);
        assert_eq!(run(svc, &[b"EXISTS", b"b", b"c", b"d", b"e"]), b":1\r\n");
        let left = String::from_utf8(run(svc, &[b"PTTL", b"c"])).unwrap();
        let left: u64 = left.trim_start_matches(':').trim_end().parse().unwrap();
        assert!((40_000..=50_000).contains(&left), "{left}");
    }
    std::fs::remove_file(path).unwrap();
    std::fs::remove_file(other_path).unwrap();
}

/// A value whose bytes on the target changed under the service (a failing disk) is
/// answered as a miss and its key removed; the values beside it are served as written.
#[test]
fn a_value_the_target_changed_is_answered_as_a_miss() {
    use std::os::unix::fs::FileExt;
    let (svc, path) = service("corrupt", 16 * 4096, 4096);
    run(&svc, &[b"SET", b"a", &[1; 5000]]);
    run(&svc, &[b"MSET", b"b", &[2; 100], b"c", &[3; 4096]]);
    // A fresh store hands out blocks in order after the superblock's: `a` has 1 and
    // 2, `b` 3, `c` 4.
    let flip = |at: u64| {
        let disk = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        disk.write_all_at(&[0xff], at).unwrap();
    };
    flip(3 * 4096 + 7);
    // The replies around the corrupt one, a missing key's among them, stay whole.
    let mut expect = b"*4\r\n".to_vec();
    reply::bulk(&mut expect, &[1; 5000]);
    reply::null(&mut expect, Proto::Resp2);
    reply::null(&mut expect, Proto::Resp2);
    reply::bulk(&mut expect, &[3; 4096]);
    assert_eq!(run(&svc, &[b"MGET", b"a", b"none", b"b", b"c"]), expect);
    assert_eq!(run(&svc, &[b"EXISTS", b"a", b"b", b"c"]), b":2\r\n");
    flip(4096 + 4999);
    assert_eq!(run(&svc, &[b"GET", b"a"]), b"$-1\r\n");
    assert_eq!(svc.counters.corrupt_values.load(Relaxed), 2);
    assert_eq!(svc.counters.misses.load(Relaxed), 3);
    assert!(svc.info().contains("corrupt_values:2\r\n"));
    // Written again, the key is served again.
    run(&svc, &[b"SET", b"a", b"again"]);
    assert_eq!(run(&svc, &[b"GET", b"a"]), b"$5\r\nagain\r\n");
    std::fs::remove_file(path).unwrap();
}

/// Values up to `inline_max` bytes are answered from memory, never read from the target,
/// and written to it only when the service stops, for the next start to read.
#[test]
fn small_values_are_kept_in_memory_and_written_when_the_service_stops() {
    let path = std::env::temp_dir().join(format!("dpuflow-kv-{}-inline", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let svc = on_with(&path, 64 * 4096, 4096, 100);
    let (reads, writes) = (&svc.counters.storage[READ], &svc.counters.storage[WRITE]);
    let big = [7u8; 5000];
    assert_eq!(run(&svc, &[b"SET", b"meta", b"tiny"]), b"+OK\r\n");
    assert_eq!(
        run(&svc, &[b"MSET", b"a", &[1; 100], b"big", &big]),
        b"+OK\r\n"
    );
    assert_eq!(
        writes.count.load(Relaxed),
        1,
        "only the large value is written"
    );
    let mut expect = b"*4\r\n".to_vec();
    reply::bulk(&mut expect, b"tiny");
    reply::null(&mut expect, Proto::Resp2);
    reply::bulk(&mut expect, &big);
    reply::bulk(&mut expect, &[1; 100]);
    assert_eq!(
        run(&svc, &[b"MGET", b"meta", b"none", b"big", b"a"]),
        expect
    );
    assert_eq!(run(&svc, &[b"GET", b"a"]), encoded(&[1; 100]));
    assert_eq!(reads.count.load(Relaxed), 1, "only the large value is read");
    assert_eq!(svc.gauges().inline_bytes, 104);
    assert!(svc.info().contains("inline_bytes:104\r\n"));
    assert_eq!(svc.counters.hits.load(Relaxed), 4);
    assert_eq!(svc.counters.misses.load(Relaxed), 1);
    // Overwritten by a value too large to keep, a key's value goes to the target.
    run(&svc, &[b"SET", b"a", &[2; 101]]);
    assert_eq!(writes.count.load(Relaxed), 2);
    assert_eq!(svc.gauges().inline_bytes, 4);
    svc.stop.store(true, Relaxed);
    svc.shutdown();
    // The next start reads them from the target, checksums checked.
    let svc = on(&path, 64 * 4096, 4096);
    assert_eq!(run(&svc, &[b"GET", b"meta"]), b"$4\r\ntiny\r\n");
    assert_eq!(run(&svc, &[b"GET", b"a"]), encoded(&[2; 101]));
    assert_eq!(svc.counters.corrupt_values.load(Relaxed), 0);
    assert_eq!(svc.counters.storage[READ].count.load(Relaxed), 2);
    std::fs::remove_file(path).unwrap();
}

/// `data` as a bulk string.
fn encoded(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    reply::bulk(&mut out, data);
    out
}

/// An MSET whose values, taken together, need more room than there is while a reader
/// holds most of the store: the values waiting to be written go first, then the
/// oldest are evicted for the rest, as SETs one after another would leave the store;
/// a value larger than the store fails alone.
#[test]
fn an_mset_short_of_room_evicts_as_sets_in_turn_would() {
    // 31 blocks of 512 bytes for values (one of the 32 is reserved); a run of writes
    // holds blocks for at most 1 KiB (a sixteenth of the store).
    let (svc, path) = service("mset-room", 32 * 512, 512);
    let fillers: Vec<String> = (0..29).map(|i| format!("f{i}")).collect();
    for key in &fillers {
        run(&svc, &[b"SET", key.as_bytes(), &[9; 512]]);
    }
    // Evicted, the fillers' blocks stay taken until this reader lets them go.
    let held: Vec<_> = fillers
        .iter()
        .map(|k| svc.lock().get(k.as_bytes()))
        .collect();
    let v = |b: u8| vec![b; 256];
    let reply = run(&svc, &[b"MSET", b"a", &v(1), b"b", &v(2), b"c", &v(3)]);
    assert_eq!(reply, b"+OK\r\n");
    // `c` found no room while `a` and `b` waited; written, `a` was the oldest to evict.
    assert_eq!(run(&svc, &[b"EXISTS", b"f0", b"a", b"b", b"c"]), b":2\r\n");
    for (key, byte) in [(&b"b"[..], 2), (b"c", 3)] {
        let mut expect = Vec::new();
        reply::bulk(&mut expect, &v(byte));
        assert_eq!(run(&svc, &[b"GET", key]), expect);
    }
    drop(held);
    let reply = run(&svc, &[b"MSET", b"d", &v(5), b"huge", &[6; 32 * 512]]);
    assert!(reply.starts_with(b"-ERR the value (16384 bytes) is larger"));
    assert_eq!(run(&svc, &[b"STRLEN", b"d"]), b":256\r\n");
    std::fs::remove_file(path).unwrap();
}

/// Clients overwrite, delete and read a few keys at once in a store too small for them
/// all, so values are evicted and blocks reused while being read: every read returns a
/// whole value some client wrote, never a mix, never an error.
#[test]
fn concurrent_writers_and_readers_never_see_a_torn_value() {
    // 28 blocks for values: fewer than the 10 keys' 30, so keys may be evicted, and more
    // than 8 clients can hold at once (3 each), so there is always room.
    let (svc, path) = service("concurrent", 29 * 4096, 4096);
    // Value `v` of key `k`: 3 blocks of one byte repeated, `(k * 16 + v) % 251`, so a
    // torn read mixes two bytes.
    let fill = |k: usize, v: usize| vec![((k * 16 + v) % 251) as u8; 3 * 4096 - 7];
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let svc = Arc::clone(&svc);
            std::thread::spawn(move || {
                for i in 0..3000 {
                    let k = (i * 7 + t) % 10;
                    let key = format!("k{k}");
                    let mut out = Replies::with_capacity(0);
                    match (i + t) % 5 {
                        0 | 1 => {
                            svc.execute(
                                &[b"SET", key.as_bytes(), &fill(k, i % 16)],
                                &mut out,
                                &mut session(&svc),
                            );
                            assert_eq!(out.pending(), b"+OK\r\n");
                        }
                        2 => {
                            svc.execute(&[b"DEL", key.as_bytes()], &mut out, &mut session(&svc));
                        }
                        _ => {
                            svc.execute(&[b"GET", key.as_bytes()], &mut out, &mut session(&svc));
                            let out = out.pending();
                            if out == b"$-1\r\n" {
                                continue;
                            }
                            let len = 3 * 4096 - 7;
                            let head = format!("${len}\r\n");
                            assert!(
                                out.starts_with(head.as_bytes()),
                                "{:?}",
                                &out[..20.min(out.len())]
                            );
                            let body = &out[head.len()..head.len() + len];
                            assert!(body.iter().all(|&b| b == body[0]), "a torn value");
                            assert_eq!(usize::from(body[0]) / 16, k, "another key's value");
                        }
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // 9,600 values of 3 blocks went through 28 blocks: every block was reused over and
    // over, under readers or not. (Whether eviction, rather than DEL and overwrites,
    // freed some of them depends on the threads' timing.)
    assert_eq!(
        svc.counters.written_bytes.load(Relaxed),
        9600 * (3 * 4096 - 7)
    );
    std::fs::remove_file(path).unwrap();
}
