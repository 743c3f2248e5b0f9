//! Any bytes a client sends a running KV-cache service (storing on two local files, the
//! store striped over them), over a real connection: the service answers and closes,
//! never panics or hangs. Inputs of an odd length go to a service that is a node of a
//! two-node cluster (keys of half the slots its own, the rest redirected), of an even
//! length to a standalone one. The services live across inputs, as they do across
//! clients. Everything runs in a network namespace of its own (as root), where only
//! loopback is up: a request can make the service connect anywhere (`MIGRATE host
//! port`), and the fuzzer's must not leave the machine.
#![no_main]

use dpuflow::ir::{KvCache, NvmeDigests, StorageTarget};
use dpuflow::kvcache::server::KvService;
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

/// Moves this thread, and the threads and processes it starts from now on, into a new
/// network namespace with loopback up.
fn isolate_network() {
    static ISOLATED: Once = Once::new();
    ISOLATED.call_once(|| {
        // SAFETY: unshare(2) takes no pointers; it changes only this thread's namespace.
        let moved = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            moved,
            0,
            "a network namespace of its own (run as root): {}",
            std::io::Error::last_os_error()
        );
        let up = Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("`ip` is required (iproute2)");
        assert!(up.success(), "loopback not brought up: {up}");
    });
}

fn service(in_cluster: bool) -> SocketAddr {
    isolate_network();
    static SERVICES: [OnceLock<Arc<KvService>>; 2] = [OnceLock::new(), OnceLock::new()];
    SERVICES[usize::from(in_cluster)]
        .get_or_init(|| {
            let capacity = 16 << 20;
            let targets = ["a", "b"]
                .iter()
                .map(|half| {
                    let path = std::env::temp_dir().join(format!(
                        "dpuflow-fuzz-kv-{}-{in_cluster}-{half}.img",
                        std::process::id()
                    ));
                    std::fs::File::create(&path)
                        .and_then(|f| f.set_len(capacity / 2))
                        .expect("make the store");
                    StorageTarget::Local { path }
                })
                .collect();
            let listen: SocketAddr = "127.0.0.1:0".parse().expect("address");
            let config = KvCache {
                listen,
                targets,
                capacity,
                block_size: 4096,
                // Values of a few blocks already span both files.
                stripe: 16384,
                connections: 2,
                inline_max: 64,
                checkpoint: Some(Duration::from_secs(1)),
                nvme_digests: NvmeDigests::default(),
                page_cache: None,
                discard: true,
                io_timeout: Duration::from_secs(30),
                max_clients: dpuflow::ir::DEFAULT_MAX_CLIENTS,
                slowlog: Some(Duration::ZERO),
                password_file: None,
                tls: None,
                // The node listed first, as it listens: slots 0 to 8191.
                cluster: match in_cluster {
                    true => vec![listen, "127.0.0.1:1".parse().expect("address")],
                    false => Vec::new(),
                },
                cluster_leaving: false,
            };
            KvService::start("fuzz", &config, Arc::new(AtomicBool::new(false)))
                .expect("start the service")
        })
        .listen
}

fuzz_target!(|bytes: &[u8]| {
    let mut client = TcpStream::connect(service(bytes.len() % 2 == 1)).expect("connect");
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut writer = client.try_clone().expect("clone");
    std::thread::scope(|s| {
        // Written from another thread: a reply as large as the store may need reading
        // before the rest of the request goes.
        s.spawn(move || {
            let _ = writer.write_all(bytes);
            let _ = writer.shutdown(Shutdown::Write);
        });
        let mut sink = [0u8; 65536];
        loop {
            match client.read(&mut sink) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                // libFuzzer's SIGALRM (every 601 s with its default -timeout) ends a read
                // that has a timeout with EINTR (signal(7)): nothing happened to the
                // connection.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("the service did not answer and close: {e}"),
            }
        }
    });
});
