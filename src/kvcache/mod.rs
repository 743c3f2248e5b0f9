//! KV-cache storage initiation: LLM inference hosts put and get KV-cache blocks over the
//! Redis protocol ([`resp`]); the DPU keeps the index ([`index`]) and does the storage
//! I/O itself ([`storage`]: a local device or file, an NBD export through [`nbd`], or an
//! NVMe/TCP namespace through [`nvme_tcp`]), so the hosts' CPUs stay out of it. [`server`] puts them together as a service of
//! `dpuflow run`, over TLS where configured ([`crate::tls`]).

pub mod dump;
mod free;
pub mod glob;
pub mod index;
mod keys;
pub mod nbd;
pub mod nvme_tcp;
pub mod persist;
pub mod resp;
pub mod server;
pub mod storage;

/// A peer's side of a conversation, scripted for tests: the bytes it sends, and a record of
/// what it was sent.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Script {
    pub to_client: std::io::Cursor<Vec<u8>>,
    pub from_client: Vec<u8>,
}

#[cfg(test)]
impl Script {
    pub fn new(to_client: Vec<u8>) -> Script {
        Script {
            to_client: std::io::Cursor::new(to_client),
            from_client: Vec::new(),
        }
    }
}

#[cfg(test)]
impl std::io::Read for Script {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.to_client.read(buf)
    }
}

#[cfg(test)]
impl std::io::Write for Script {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.from_client.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A TCP peer that takes one connection and says nothing (a hung target); the handle
/// returns the connection, held until then.
#[cfg(test)]
fn silent_peer() -> (
    std::net::SocketAddr,
    std::thread::JoinHandle<std::io::Result<std::net::TcpStream>>,
) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    (
        addr,
        std::thread::spawn(move || listener.accept().map(|(c, _)| c)),
    )
}

#[cfg(test)]
impl nbd::QuickAck for Script {
    fn quick_ack(&self) {}
}
