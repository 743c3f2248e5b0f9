//! Any bytes a client sends a running KV-cache service (storing on two local files, the
//! store striped over them), over a real connection: the service answers and closes,
//! never panics or hangs. The service lives across inputs, as it does across clients.
#![no_main]

use dpuflow::ir::{KvCache, NvmeDigests, StorageTarget};
use dpuflow::kvcache::server::KvService;
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

fn service() -> SocketAddr {
    static SERVICE: OnceLock<Arc<KvService>> = OnceLock::new();
    SERVICE
        .get_or_init(|| {
            let capacity = 16 << 20;
            let targets = ["a", "b"]
                .iter()
                .map(|half| {
                    let path = std::env::temp_dir()
                        .join(format!("dpuflow-fuzz-kv-{}-{half}.img", std::process::id()));
                    std::fs::File::create(&path)
                        .and_then(|f| f.set_len(capacity / 2))
                        .expect("make the store");
                    StorageTarget::Local { path }
                })
                .collect();
            let config = KvCache {
                listen: "127.0.0.1:0".parse().expect("address"),
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
            };
            KvService::start("fuzz", &config, Arc::new(AtomicBool::new(false)))
                .expect("start the service")
        })
        .listen
}

fuzz_target!(|bytes: &[u8]| {
    let mut client = TcpStream::connect(service()).expect("connect");
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
