//! The KV-cache service: a Redis-protocol server whose values are stored on the storage
//! target in whole blocks, with the index in memory. A thread accepts connections and a
//! thread serves each one; requests on a connection may be pipelined and are answered in
//! order. Values move between the connection and the target without passing through
//! the index, which is locked only to look up, allocate and publish.
//!
//! Here: starting, connections and the reading of requests. The values' I/O is in
//! `values`, the other commands in `commands`, the index saved on the target in
//! `saved`.

use super::index::Index;
use super::persist::{self, Layout};
use super::resp::{self, reply, Awaited, Proto};
use super::storage::{self, Pool, TargetError};
use crate::ir::KvCache;
use clients::{ClientInfo, Clients};
use monitor::{Monitors, Watch};
use slowlog::SlowLog;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::{Deref, DerefMut, Range};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

mod catalog;
mod clients;
mod cluster;
mod commands;
mod handoff;
mod migrate;
mod monitor;
mod peer;
mod saved;
mod serialized;
mod slowlog;
mod transaction;
mod values;

pub use saved::{inspect, Inspection, Strangers};
use saved::{saved_index, Checkpoints};

/// A client connection's read buffer, and its reply buffer, while the client is quiet.
const READ_BUFFER: usize = 64 << 10;
/// The boundary a large value read from the target is placed on in its reply.
const CACHE_LINE: usize = 64;
/// The least backlog of connections not yet accepted: Redis's `tcp-backlog`.
const LEAST_BACKLOG: u64 = 511;
/// How often blocked threads look at the stop flag.
const POLL: Duration = Duration::from_millis(200);

/// Why the service cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// the storage target cannot be used
    #[error("kvcache `{service}`: {source}")]
    Target {
        service: String,
        source: TargetError,
    },
    /// the password file cannot be read or is empty
    #[error("kvcache `{service}`: password file {}: {source}", path.display())]
    Password {
        service: String,
        path: std::path::PathBuf,
        source: io::Error,
    },
    /// the TLS certificate, key or client CAs cannot be used
    #[error("kvcache `{service}`: TLS: {source}")]
    Tls {
        service: String,
        source: Box<crate::tls::TlsError>,
    },
    /// the superblock cannot be read or marked taken
    #[error("kvcache `{service}`: cannot read or update the target's superblock: {source}")]
    Superblock { service: String, source: io::Error },
    /// the listening address cannot be bound
    #[error("kvcache `{service}`: cannot listen on {addr}: {source}")]
    Listen {
        service: String,
        addr: SocketAddr,
        source: io::Error,
    },
}

/// How long a client's connection may be idle before it is probed (Redis's default
/// `tcp-keepalive`): a host gone without closing it (powered off, cut off) frees its
/// thread within ten minutes instead of never.
const CLIENT_KEEP_ALIVE: Duration = Duration::from_secs(300);

/// Keys past their deadline a command removes before it looks at the index (about 0.4 ms
/// of the lock; 1024 took 1.3 ms); the rest, gone to it all the same, wait for the next
/// ones. Removing them all at once held every request up: 117–134 ms when 200,000 keys
/// given one deadline passed it together (`bench/kv-expiry.sh`).
const PURGED_AT_ONCE: usize = 256;

/// The commands counted by name; any other is counted as `other`.
pub const COMMANDS: &[&str] = &[
    "get", "set", "mget", "mset", "del", "exists", "strlen", "dbsize", "flushall", "ping", "info",
    "expire", "ttl", "persist", "other",
];

/// Every command the service serves, sorted: what `COMMAND COUNT` counts and
/// INFO's commandstats lists (a test checks that each is served).
pub const SERVED: [&str; catalog::CATALOG.len()] = catalog::names();

/// The password in the file at `path`: its first line, which must not be empty.
fn read_password(path: &std::path::Path) -> io::Result<Vec<u8>> {
    let text = std::fs::read(path)?;
    let line = text.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    if line.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "empty"));
    }
    Ok(line.to_vec())
}

/// A client connection, counted in `clients` and listed (`CLIENT LIST`) while it lives:
/// uncounted and unlisted when its thread ends, however it ends (a bug's panic included),
/// so the count cannot creep up to `max_clients` and lock everyone out.
struct Client {
    svc: Arc<KvService>,
    info: Arc<ClientInfo>,
}

impl Client {
    fn count(svc: Arc<KvService>, addr: SocketAddr, laddr: SocketAddr, fd: i32) -> Client {
        svc.counters.clients.fetch_add(1, Relaxed);
        svc.counters.connections.fetch_add(1, Relaxed);
        let info = svc.clients.register(addr, laddr, fd);
        Client { svc, info }
    }

    /// What its requests start from: RESP2, authenticated where no password is asked.
    fn session(&self) -> Session {
        Session {
            proto: Proto::Resp2,
            authed: self.svc.password.is_none(),
            monitoring: None,
            client: Arc::clone(&self.info),
            transaction: None,
            watched: Vec::new(),
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.svc.clients.unregister(self.info.id);
        self.svc.counters.clients.fetch_sub(1, Relaxed);
    }
}

/// What a connection's requests read and change of it.
pub(super) struct Session {
    /// The protocol its replies are in: RESP2 until `HELLO 3`.
    pub proto: Proto,
    pub authed: bool,
    /// It asked for `MONITOR`: the lines it is to stream once its replies are sent.
    pub monitoring: Option<crossbeam_channel::Receiver<Vec<u8>>>,
    pub client: Arc<ClientInfo>,
    /// The requests queued since its `MULTI`, while in a transaction.
    transaction: Option<transaction::Queued>,
    /// The keys it `WATCH`es.
    watched: Vec<transaction::Watched>,
}

/// The time of day in unix milliseconds, the clock deadlines are in.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The key of a `GET key` request.
fn get_of<'a>(req: &'a [u8], args: &[Range<usize>]) -> Option<&'a [u8]> {
    match args {
        [name, key] if req[name.clone()].eq_ignore_ascii_case(b"get") => Some(&req[key.clone()]),
        _ => None,
    }
}

/// The keys of an `MGET key [key …]` request.
fn mget_of<'a>(req: &'a [u8], args: &[Range<usize>]) -> Option<Vec<&'a [u8]>> {
    match args {
        [name, keys @ ..]
            if !keys.is_empty() && req[name.clone()].eq_ignore_ascii_case(b"mget") =>
        {
            Some(keys.iter().map(|k| &req[k.clone()]).collect())
        }
        _ => None,
    }
}

/// Sends the replies made so far, and empties the buffer for more.
fn send(stream: &mut impl Write, out: &mut Replies) -> io::Result<()> {
    stream.write_all(out.pending())?;
    stream.flush()?;
    out.clear();
    Ok(())
}

/// A client's connection, counting the bytes read from it and written to it. A write the
/// client takes nothing of for a while (a host hung with its receive window shut, which
/// keepalives never end) waits on until the connection is killed or the service stops.
struct Metered<'a, S> {
    inner: S,
    counters: &'a KvCounters,
    client: &'a ClientInfo,
    stop: &'a AtomicBool,
}

impl<S: Read> Read for Metered<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.counters.client_read_bytes.fetch_add(n as u64, Relaxed);
        Ok(n)
    }
}

impl<S> Metered<'_, S> {
    /// `op` on the connection, again each time it times out while the connection is
    /// still wanted.
    fn patiently<T>(&mut self, mut op: impl FnMut(&mut S) -> io::Result<T>) -> io::Result<T> {
        loop {
            match op(&mut self.inner) {
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) && !self.client.is_killed()
                        && !self.stop.load(Relaxed) => {}
                done => return done,
            }
        }
    }
}

impl<S: Write> Write for Metered<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.patiently(|s| s.write(buf))?;
        self.counters
            .client_written_bytes
            .fetch_add(n as u64, Relaxed);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.patiently(|s| s.flush())
    }
}

/// The key and value of a `SET key value` request (no options).
fn set_of<'a>(req: &'a [u8], args: &[Range<usize>]) -> Option<(&'a [u8], &'a [u8])> {
    match args {
        [name, key, value] if req[name.clone()].eq_ignore_ascii_case(b"set") => {
            Some((&req[key.clone()], &req[value.clone()]))
        }
        _ => None,
    }
}

/// The words of a `RESTORE` or `RESTORE-ASKING` request of at least its key, ttl and
/// payload.
fn restore_of<'a>(req: &'a [u8], args: &[Range<usize>]) -> Option<Vec<&'a [u8]>> {
    let name = &req[args.first()?.clone()];
    let restore =
        name.eq_ignore_ascii_case(b"restore") || name.eq_ignore_ascii_case(b"restore-asking");
    (restore && args.len() >= 4).then(|| args.iter().map(|r| &req[r.clone()]).collect())
}

/// The commands whose durations are kept, in [`KvCounters::durations`].
pub const TIMED: [&str; 2] = ["get", "set"];

/// Upper bounds of the request-duration histograms, in seconds.
pub const DURATION_BUCKETS: [f64; 12] = [
    50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 100e-3, 1.0,
];

/// Storage operations timed, in [`KvCounters::storage`]: a value's reads, its writes.
pub const STORAGE_OPERATIONS: [&str; 2] = ["read", "write"];
const READ: usize = 0;
const WRITE: usize = 1;

/// A histogram of durations over [`DURATION_BUCKETS`]: of one command's requests, from
/// the request read to its reply written to the reply buffer (storage I/O included); of a
/// value's storage I/O; of waits for a target connection.
#[derive(Debug, Default)]
pub struct Durations {
    /// Per bucket of [`DURATION_BUCKETS`], not cumulative; the last is +Inf.
    pub buckets: [AtomicU64; DURATION_BUCKETS.len() + 1],
    pub count: AtomicU64,
    pub sum_ns: AtomicU64,
}

impl Durations {
    fn observe(&self, took: Duration) {
        self.observe_n(took, 1);
    }

    /// `n` events that each took `took`.
    fn observe_n(&self, took: Duration, n: u64) {
        let seconds = took.as_secs_f64();
        let i = DURATION_BUCKETS
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(DURATION_BUCKETS.len());
        self.buckets[i].fetch_add(n, Relaxed);
        self.count.fetch_add(n, Relaxed);
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns.saturating_mul(n), Relaxed);
    }
}

/// A count for each command of [`SERVED`] (more than `Default` makes for an array).
#[derive(Debug)]
pub struct PerServed(pub [AtomicU64; SERVED.len()]);

impl Default for PerServed {
    fn default() -> PerServed {
        PerServed(std::array::from_fn(|_| AtomicU64::new(0)))
    }
}

/// What the service counts, for metrics and INFO.
#[derive(Debug, Default)]
pub struct KvCounters {
    pub commands: [AtomicU64; COMMANDS.len()],
    /// Per command of [`SERVED`], its requests and the time they took to serve, in
    /// nanoseconds (INFO's commandstats); a run of pipelined requests served together
    /// counts its time once.
    pub calls: PerServed,
    pub call_ns: PerServed,
    /// Per command of [`TIMED`].
    pub durations: [Durations; TIMED.len()],
    /// A value's I/O on a target connection, all its pieces, per operation of
    /// [`STORAGE_OPERATIONS`].
    pub storage: [Durations; STORAGE_OPERATIONS.len()],
    /// Waits for a free target connection (all `connections` busy with other requests).
    pub connection_waits: Durations,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    pub storage_errors: AtomicU64,
    /// Values read back whose checksum did not match what was written.
    pub corrupt_values: AtomicU64,
    pub clients: AtomicU64,
    /// Bytes read from and written to hosts' connections (inside TLS, where configured).
    pub client_read_bytes: AtomicU64,
    pub client_written_bytes: AtomicU64,
    /// Client connections accepted (Redis's `total_connections_received`).
    pub connections: AtomicU64,
    pub rejected_clients: AtomicU64,
    /// `AUTH` (or `HELLO … AUTH`) with a wrong password.
    pub auth_failures: AtomicU64,
    /// Requests a node of a cluster answered `MOVED` (a key of another node's slot) or
    /// `CROSSSLOT` (keys of two slots) rather than served.
    pub redirected: AtomicU64,
    /// Keys of slots another node serves since the node list changed, taken by that
    /// node (see the `handoff` module).
    pub handed_off: AtomicU64,
    /// The hand-off under way: its round, and the keys held of slots another node
    /// serves, not yet handed over.
    pub handoffs: handoff::Handoffs,
    /// Connections that ended in a TLS error: a failed handshake (no or an untrusted
    /// client certificate, a client that does not trust ours, plaintext) or a bad record.
    pub tls_failures: AtomicU64,
    /// Checkpoints of the index saved, and failed.
    pub checkpoints: AtomicU64,
    pub checkpoint_failures: AtomicU64,
    /// Bytes of freed blocks discarded on the target (`discard on`), and discards that
    /// failed.
    pub discarded_bytes: AtomicU64,
    pub discard_failures: AtomicU64,
    /// Checkpoints saved as a delta on the one before.
    pub checkpoint_deltas: AtomicU64,
    /// Bytes of snapshots and deltas checkpoints wrote (padded to whole blocks).
    pub checkpoint_bytes: AtomicU64,
    /// When a checkpoint last saved the index, unix milliseconds; 0 before the first.
    pub last_save_ms: AtomicU64,
    /// [`Index::changes`] at the last checkpoint, and whether the last one attempted failed
    /// (for INFO's persistence section).
    changes_at_last_save: AtomicU64,
    last_save_failed: AtomicBool,
}

/// One KV-cache service.
#[derive(Debug)]
pub struct KvService {
    pub name: String,
    pub listen: SocketAddr,
    pub config: KvCache,
    index: Mutex<Index>,
    pool: Pool,
    /// I/O alignment of the target (a power of two dividing the block size).
    align: u64,
    pub counters: KvCounters,
    stop: Arc<AtomicBool>,
    /// What clients must give `AUTH` before anything else, if anything.
    password: Option<Vec<u8>>,
    /// TLS on every connection, when configured.
    tls: Option<crate::tls::Rotating>,
    /// Keys the start restored from the index saved on the target.
    pub restored_keys: u64,
    checkpoints: Mutex<Checkpoints>,
    /// When it started serving (INFO's uptime).
    started: Instant,
    /// The connections being served.
    clients: Clients,
    slowlog: SlowLog,
    /// The connections streaming the requests served (`MONITOR`).
    monitors: Monitors,
    /// The cluster this service is a node of, if it is one; another on a reload that
    /// changes the node list ([`KvService::regroup`]).
    cluster: RwLock<Option<Arc<cluster::Cluster>>>,
    /// Requests served at once, or a transaction's alone.
    turns: transaction::Turns,
    /// The connections `MIGRATE` made, kept for the next.
    migrations: migrate::Connections,
}

/// A snapshot of a service's index for metrics.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvGauges {
    pub keys: u64,
    pub used_bytes: u64,
    pub capacity_bytes: u64,
    pub evictions: u64,
    /// Keys with a deadline.
    pub expiring: u64,
    /// Keys removed for having passed their deadline.
    pub expired: u64,
    /// Bytes of values kept in memory (`inline_max`).
    pub inline_bytes: u64,
    /// Times values took blocks held back for the last checkpoint.
    pub hold_back_overruns: u64,
}

impl KvService {
    /// Connects to the target and starts listening; connections are served until `stop`
    /// is set.
    pub fn start(
        name: &str,
        config: &KvCache,
        stop: Arc<AtomicBool>,
    ) -> Result<Arc<KvService>, StartError> {
        let target_err = |source| StartError::Target {
            service: name.to_owned(),
            source,
        };
        let password = match &config.password_file {
            Some(path) => Some(read_password(path).map_err(|source| StartError::Password {
                service: name.to_owned(),
                path: path.clone(),
                source,
            })?),
            None => None,
        };
        let tls =
            match &config.tls {
                Some(files) => Some(crate::tls::Rotating::new(files, true).map_err(|source| {
                    StartError::Tls {
                        service: name.to_owned(),
                        source: Box::new(source),
                    }
                })?),
                None => None,
            };
        let pool = Pool::connect(config).map_err(target_err)?;
        let align = pool.alignment();
        if config.block_size % align != 0 {
            return Err(target_err(TargetError::Misaligned {
                target: storage::describe_all(&config.targets),
                block_size: config.block_size,
                align,
            }));
        }
        if config.discard && !pool.with(|t| Ok(t.discards())).unwrap_or(false) {
            return Err(target_err(TargetError::NoDiscards {
                target: storage::describe_all(&config.targets),
            }));
        }
        // A saved index that cannot be read, or whose superblock cannot be marked taken,
        // must not outlive this start: refused rather than served.
        let (mut index, kept) =
            saved_index(name, config, &pool).map_err(|source| StartError::Superblock {
                service: name.to_owned(),
                source,
            })?;
        // Keys of slots another node serves (the node list changed, or this node is
        // leaving) go to that node.
        let cluster = cluster::Cluster::new(&config.cluster, config.listen, config.cluster_leaving);
        let strangers = cluster
            .as_ref()
            .map(|c| handoff::strangers(&index, c))
            .unwrap_or_default();
        let peer_tls = tls.as_ref().and_then(crate::tls::Rotating::peer);
        let waiting: usize = strangers.iter().map(|(_, keys)| keys.len()).sum();
        // Over TLS without `tls_client_ca` nothing says the other node is the one listed.
        let handing = waiting > 0 && (config.tls.is_none() || peer_tls.is_some());
        if waiting > 0 && !handing {
            handoff::drop_unverifiable(&mut index, &strangers, name);
        } else if handing {
            tracing::info!(
                service = name,
                keys = waiting,
                nodes = strangers.len(),
                "kvcache: handing the saved keys of hash slots other cluster nodes serve to those nodes"
            );
        }
        let restored_keys = index.stats().keys;
        if config.discard {
            index.discard_freed();
        }
        let checkpoints = Checkpoints::restored(kept, &mut index);
        let listen_err = |source| StartError::Listen {
            service: name.to_owned(),
            addr: config.listen,
            source,
        };
        let listener = TcpListener::bind(config.listen).map_err(listen_err)?;
        // Room for every client to connect at once (all of a host's workers after the
        // service restarts, say): more than std's 128 are accepted without a SYN retried.
        // At least Redis's `tcp-backlog`.
        let backlog = u32::try_from(config.max_clients.max(LEAST_BACKLOG)).unwrap_or(u32::MAX);
        crate::sys::listen_backlog(&listener, backlog).map_err(listen_err)?;
        let listen = listener.local_addr().unwrap_or(config.listen);
        let svc = Arc::new(KvService {
            name: name.to_owned(),
            listen,
            config: config.clone(),
            index: Mutex::new(index),
            pool,
            align,
            counters: KvCounters::default(),
            stop,
            password,
            tls,
            restored_keys,
            checkpoints: Mutex::new(checkpoints),
            started: Instant::now(),
            clients: Clients::default(),
            slowlog: SlowLog::new(config.slowlog),
            monitors: Monitors::default(),
            cluster: RwLock::new(cluster.map(Arc::new)),
            turns: transaction::Turns::default(),
            migrations: migrate::Connections::default(),
        });
        let spawn = |thread: String, work: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(thread)
                .spawn(work)
                .map_err(|source| StartError::Listen {
                    service: name.to_owned(),
                    addr: config.listen,
                    source,
                })
        };
        if let Some(every) = config.checkpoint {
            let s = Arc::clone(&svc);
            spawn(
                format!("kv-{name}-save"),
                Box::new(move || s.take_checkpoints(every)),
            )?;
        }
        if config.discard {
            let s = Arc::clone(&svc);
            spawn(
                format!("kv-{name}-discard"),
                Box::new(move || s.discard_freed_blocks()),
            )?;
        }
        if handing {
            let round = svc.counters.handoffs.begin();
            svc.counters.handoffs.waiting_for(round, waiting as u64);
            let s = Arc::clone(&svc);
            spawn(
                format!("kv-{name}-handoff"),
                Box::new(move || s.hand_off(strangers, round)),
            )?;
        }
        let s = Arc::clone(&svc);
        spawn(format!("kv-{name}"), Box::new(move || s.accept(listener)))?;
        tracing::info!(service = name, listen = %listen, targets = %storage::describe_all(&config.targets),
            capacity = config.capacity, block_size = config.block_size,
            io = svc.pool.io_path(), "kvcache serving");
        Ok(svc)
    }

    /// Saves the index for the next start (see [`persist`]), once the clients have gone
    /// (they leave within 200 ms of the stop, or after the request they are serving);
    /// called after the stop. The values kept in memory are written to their blocks
    /// first. A failure is logged: the next start will be empty, or have the last
    /// checkpoint.
    pub fn shutdown(&self) {
        let since = Instant::now();
        while self.counters.clients.load(Relaxed) > 0 && since.elapsed() < 10 * POLL {
            std::thread::sleep(POLL / 10);
        }
        // A connection that failed just before is not the last word on a target the
        // saved index is worth trying again.
        self.pool.failures().until_reconnect();
        // After any checkpoint under way.
        let mut checkpoints = self
            .checkpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut index = self.lock();
        if let Err(e) = self.write_inline(&index.inline_values()) {
            tracing::warn!(service = %self.name, error = %e, "kvcache values kept in memory not written: the index is not saved");
            return;
        }
        let Some(save) = persist::prepare(&mut index, &Layout::of(&self.config)) else {
            tracing::warn!(service = %self.name, "kvcache index too large to save");
            return;
        };
        let keys = index.stats().keys;
        drop(index);
        match self.write_save(&save) {
            Ok(()) => tracing::info!(service = %self.name, keys, "kvcache index saved"),
            Err(e) => {
                tracing::warn!(service = %self.name, error = %e, "kvcache index not saved")
            }
        }
        // Its blocks stay taken until the process ends: freed, they would be discarded
        // (`discard on`) by the discard's last round, which may come after this save and
        // punch holes in it.
        checkpoints.keep(save.blocks);
    }

    /// Tells the target of the blocks freed, every [`POLL`] until the service stops, before
    /// they are used again (`discard on`). A failed discard is counted and logged, and its
    /// blocks are used all the same: it would only have helped the target.
    fn discard_freed_blocks(self: Arc<Self>) {
        let mut failure_warning = crate::telemetry::WarnThrottle::default();
        let block = self.config.block_size;
        loop {
            std::thread::sleep(POLL);
            // Checked after the sleep: a stop in it ends the rounds, none after it.
            if self.stop.load(Relaxed) {
                break;
            }
            let runs = self.lock().take_undiscarded();
            if runs.is_empty() {
                continue;
            }
            let ranges: Vec<(u64, u64)> =
                runs.iter().map(|&(b, n)| (b * block, n * block)).collect();
            match self.pool.with(|t| t.discard(&ranges)) {
                Ok(()) => {
                    let bytes = ranges.iter().map(|r| r.1).sum();
                    self.counters.discarded_bytes.fetch_add(bytes, Relaxed);
                }
                Err(e) => {
                    self.counters.discard_failures.fetch_add(1, Relaxed);
                    if failure_warning.ready() {
                        tracing::warn!(service = %self.name, error = %e, "kvcache discard of freed blocks failed: they are used again undiscarded");
                    }
                }
            }
            self.lock().discarded(&runs);
        }
    }

    /// Reads its TLS files again (on SIGHUP), for the connections that arrive from now on;
    /// files that no longer make a configuration leave the one before, with a warning.
    pub fn reread_tls(&self) {
        let Some(tls) = &self.tls else { return };
        match tls.reread() {
            Ok(()) => tracing::info!(service = %self.name, "kvcache TLS files read again"),
            Err(e) => {
                tracing::warn!(service = %self.name, error = %e, "kvcache TLS files not usable: the ones read before stay")
            }
        }
    }

    /// How connections to other servers (a node keys are handed to, the target of
    /// `MIGRATE`) are made now: in plain TCP by a service that speaks no TLS, over TLS by
    /// one that does, verifying the server with the CAs of `tls_client_ca` and presenting
    /// the service's certificate; without those CAs, nothing would say the server is the
    /// one named, and the error says so.
    pub(super) fn peer_tls(&self) -> Result<Option<Arc<rustls::ClientConfig>>, &'static str> {
        match &self.tls {
            None => Ok(None),
            Some(tls) => tls.peer().map(Some).ok_or(
                "connecting over TLS needs `tls_client_ca`, to verify the server connected to",
            ),
        }
    }

    /// What failed on each of its targets.
    pub fn target_failures(&self) -> &storage::Failures {
        self.pool.failures()
    }

    pub fn gauges(&self) -> KvGauges {
        let s = self.lock().stats();
        KvGauges {
            keys: s.keys,
            used_bytes: s.used_blocks * self.config.block_size,
            capacity_bytes: s.total_blocks * self.config.block_size,
            evictions: s.evictions,
            expiring: s.expiring,
            expired: s.expired,
            inline_bytes: s.inline_bytes,
            hold_back_overruns: s.hold_back_overruns,
        }
    }

    /// The index, told the time: every command sees only live keys (those past their
    /// deadline are gone to every lookup, and their blocks go before any live key's when
    /// a value needs room), and up to [`PURGED_AT_ONCE`] of them are removed.
    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        let mut ix = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        ix.purge_expired(u64::try_from(now_ms()).unwrap_or(0), PURGED_AT_ONCE);
        ix
    }

    fn accept(self: Arc<Self>, listener: TcpListener) {
        let mut acceptor = match crate::sys::Acceptor::new(&listener) {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(service = %self.name, error = %e, "kvcache cannot poll its listener");
                return;
            }
        };
        // Descriptors exhausted fail every accept until some are closed.
        let mut accept_warning = crate::telemetry::WarnThrottle::default();
        while !self.stop.load(Relaxed) {
            self.migrations.close_idle();
            match acceptor.accept(POLL) {
                Ok(None) => {}
                Ok(Some((stream, peer))) => {
                    if self.counters.clients.load(Relaxed) >= self.config.max_clients {
                        self.counters.rejected_clients.fetch_add(1, Relaxed);
                        let mut s = stream;
                        let _ = s.write_all(b"-ERR max number of clients reached\r\n");
                        continue;
                    }
                    let local = stream.local_addr().unwrap_or(self.listen);
                    let fd = stream.as_raw_fd();
                    let client = Client::count(Arc::clone(&self), peer, local, fd);
                    let spawned = std::thread::Builder::new()
                        .name(format!("kv-{}-client", self.name))
                        .spawn(move || {
                            if let Err(e) = client.svc.serve(stream, client.session()) {
                                tracing::debug!(service = %client.svc.name, %peer, error = %e, "kvcache client gone");
                            }
                        });
                    if let Err(e) = spawned {
                        tracing::warn!(service = %self.name, error = %e, "kvcache cannot start a client thread");
                    }
                }
                Err(e) => {
                    if accept_warning.ready() {
                        tracing::warn!(service = %self.name, error = %e, "kvcache accept failed");
                    }
                    std::thread::sleep(POLL);
                }
            }
        }
    }

    /// Serves one client until it leaves, breaks the protocol, or the service stops; over
    /// TLS when configured (the handshake happens with the first read).
    fn serve(&self, stream: TcpStream, session: Session) -> io::Result<()> {
        stream.set_nodelay(true)?;
        crate::sys::keep_alive(stream.as_fd(), CLIENT_KEEP_ALIVE)?;
        stream.set_read_timeout(Some(POLL))?;
        stream.set_write_timeout(Some(POLL))?;
        match &self.tls {
            Some(config) => {
                let conn =
                    rustls::ServerConnection::new(config.current()).map_err(io::Error::other)?;
                let talked = self.talk(rustls::StreamOwned::new(conn, stream), session);
                // rustls reports what breaks TLS as invalid data.
                if talked
                    .as_ref()
                    .is_err_and(|e| e.kind() == io::ErrorKind::InvalidData)
                {
                    self.counters.tls_failures.fetch_add(1, Relaxed);
                }
                talked
            }
            None => self.talk(stream, session),
        }
    }

    /// The requests and replies of one client's connection.
    fn talk(&self, stream: impl Read + Write, mut s: Session) -> io::Result<()> {
        let client = Arc::clone(&s.client);
        let mut stream = Metered {
            inner: stream,
            counters: &self.counters,
            client: &client,
            stop: &self.stop,
        };
        // Bytes read are `buf[head..filled]`; the rest is room, zeroed once when it grows
        // (not on every read: most reads are small requests). `head` is where a large
        // value's request starts so that the value lands aligned (see `place`).
        let mut buf: Vec<u8> = vec![0; READ_BUFFER];
        let (mut head, mut filled) = (0, 0);
        // The client has sent all it will (what is whole is still served).
        let mut closed = false;
        let mut args: Vec<Range<usize>> = Vec::new();
        // An inline command's words, unescaped.
        let mut inline = Vec::new();
        let mut out = Replies::with_capacity(READ_BUFFER);
        loop {
            let mut start = head;
            let mut quit = false;
            // The length, from `start`, the requests waited for will have at least, and
            // where in them the argument arriving starts, where known (a large value's
            // length arrives before its bytes).
            let mut awaited = None;
            while !quit && s.monitoring.is_none() {
                match resp::parse(&buf[start..filled], &mut args, &mut inline, self.max_bulk()) {
                    Ok(Some(n)) => {
                        let req = &buf[start..start + n];
                        // Typed by hand: served one at a time, from its unescaped words
                        // (its `args` are not in `req`).
                        let typed = resp::is_inline(req);
                        // In a transaction every request is queued (`execute`).
                        let fast = s.authed && !typed && s.transaction.is_none();
                        // While someone watches, pipelined GETs and SETs are served one
                        // by one, each shown as sent.
                        let watched = self.monitors.watching();
                        // GETs and SETs the client pipelined, as many of one kind as
                        // are here in a row, go to the target together, as an MGET's
                        // values and an MSET's do.
                        let mut end = start + n;
                        let input = &buf[..filled];
                        // On a node of a cluster, a run is of keys of this node's
                        // slots; the first of another is answered on its own.
                        let get_here = |req, args: &[Range<usize>]| {
                            get_of(req, args).filter(|k| self.serves(k))
                        };
                        if let Some(key) =
                            (fast && !watched).then(|| get_here(req, &args)).flatten()
                        {
                            let (keys, _) =
                                self.pipelined(input, &mut end, &mut args, key, get_here);
                            s.client.served("get");
                            let since = Instant::now();
                            self.values_in_shares(&keys, &mut out, &mut stream, s.proto)?;
                            let first = [&b"GET"[..], keys[0]];
                            let others = Some((keys.len() - 1, "GET"));
                            self.finished("get", keys.len(), since, first, others, &s.client);
                            start = end;
                            continue;
                        }
                        let mget_here = || {
                            let keys = mget_of(req, &args)?;
                            let here = self.cluster().is_none_or(|c| c.serves_all(&keys));
                            here.then_some(keys)
                        };
                        if let Some(keys) = fast.then(mget_here).flatten() {
                            if watched {
                                let words: Vec<&[u8]> =
                                    args.iter().map(|r| &req[r.clone()]).collect();
                                self.show(&words, &s.client);
                            }
                            s.client.served("mget");
                            let since = Instant::now();
                            reply::array(&mut out, keys.len());
                            self.values_in_shares(&keys, &mut out, &mut stream, s.proto)?;
                            let words = std::iter::once(&b"MGET"[..]).chain(keys.iter().copied());
                            self.finished("mget", 1, since, words, None, &s.client);
                            start = end;
                            continue;
                        }
                        let set_here = |req, args: &[Range<usize>]| {
                            set_of(req, args).filter(|(k, _)| self.serves(k))
                        };
                        if let Some(item) =
                            (fast && !watched).then(|| set_here(req, &args)).flatten()
                        {
                            let (items, arriving) =
                                self.pipelined(input, &mut end, &mut args, item, set_here);
                            let bytes: usize = items.iter().map(|(_, v)| v.len()).sum();
                            // A large value's SET is often served before the next has
                            // arrived whole: when one has begun to arrive (the client
                            // is sending, not waiting), the run waits for it.
                            if !closed
                                && arriving.is_some_and(|name| name.eq_ignore_ascii_case(b"set"))
                                && (bytes as u64) < self.batch_limit()
                            {
                                awaited = resp::awaited(&input[end..], &args).map(|a| Awaited {
                                    len: end - start + a.len,
                                    data: end - start + a.data,
                                });
                                break;
                            }
                            let _turn = self.turns.take(false);
                            self.set_run(&items, &mut out, &s.client);
                            start = end;
                            continue;
                        }
                        // As SETs, RESTOREs (what MIGRATE sends, many at once); a run
                        // is of those read, not waiting for the one arriving: storing
                        // them meanwhile overlaps the rest's arrival (measured faster).
                        let restore_here = |req, args: &[Range<usize>]| {
                            restore_of(req, args).filter(|words| self.serves(words[1]))
                        };
                        if let Some(first) = (fast && !watched)
                            .then(|| restore_here(req, &args))
                            .flatten()
                        {
                            let name = first[0];
                            let (requests, _) =
                                self.pipelined(input, &mut end, &mut args, first, |req, args| {
                                    let words = restore_here(req, args)?;
                                    words[0].eq_ignore_ascii_case(name).then_some(words)
                                });
                            let _turn = self.turns.take(false);
                            self.restore_run(&requests, &mut out, &s.client);
                            start = end;
                            continue;
                        }
                        let from = if typed { &inline[..] } else { req };
                        let words: Vec<&[u8]> = args.iter().map(|r| &from[r.clone()]).collect();
                        let _turn =
                            (self.turns).take(transaction::is_exec(&s, words.first().copied()));
                        quit = if s.authed {
                            self.execute(&words, &mut out, &mut s)
                        } else {
                            self.unauthenticated(&words, &mut out, &mut s)
                        };
                        start += n;
                    }
                    Ok(None) => {
                        awaited = resp::awaited(&buf[start..filled], &args);
                        break;
                    }
                    Err(e) => {
                        reply::error(&mut out, &format!("ERR {e}"));
                        quit = true;
                    }
                }
            }
            let watch =
                (s.monitoring.take()).map(|lines| Watch::new(&self.monitors, s.client.id, lines));
            if !out.is_empty() {
                send(&mut stream, &mut out)?;
            }
            // A connection `CLIENT KILL` chose ends here, after the replies it had.
            if quit || self.stop.load(Relaxed) || s.client.is_killed() {
                return Ok(());
            }
            if let Some(watch) = watch {
                return self.monitor(&mut stream, &s, &watch);
            }
            let pending = filled - start;
            match awaited.filter(|a| a.len > READ_BUFFER) {
                Some(a) => (buf, head) = self.place(buf, start..filled, a),
                None => {
                    buf.copy_within(start..filled, 0);
                    head = 0;
                }
            }
            filled = head + pending;
            if filled == buf.len() {
                // A large value is arriving: room for half as much again.
                buf.resize(filled + (filled / 2).clamp(READ_BUFFER, 16 << 20), 0);
            }
            s.client.set_buffers(buf.len(), pending, out.capacity());
            match stream.read(&mut buf[filled..]) {
                Ok(0) if closed || filled == head => return Ok(()),
                Ok(0) => closed = true,
                Ok(n) => filled += n,
                // What a read with a timeout says when the service is stopped and
                // continued (signal(7)): nothing happened to the client.
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    // Room a large value took is kept while the client keeps sending (the
                    // next value of its size reuses it, already mapped) and given back
                    // once it has been quiet for a read's timeout.
                    if filled == head && buf.len() > READ_BUFFER {
                        buf = vec![0; READ_BUFFER];
                        (head, filled) = (0, 0);
                    }
                    if out.capacity() > READ_BUFFER {
                        out = Replies::with_capacity(READ_BUFFER);
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Streams the requests every connection makes to the connection `s` (`MONITOR`)
    /// until it closes or sends `QUIT`, is killed, or the service stops. Lines are
    /// written as they come; when none are waiting it reads (for up to the socket's
    /// timeout), to notice the client leave.
    fn monitor(
        &self,
        stream: &mut (impl Read + Write),
        s: &Session,
        watch: &Watch,
    ) -> io::Result<()> {
        let lines = &watch.lines;
        let mut batch = Vec::new();
        let mut asked = [0u8; 512];
        while !self.stop.load(Relaxed) && !s.client.is_killed() {
            batch.clear();
            for line in lines.try_iter().take(4096) {
                batch.extend_from_slice(&line);
            }
            if !batch.is_empty() {
                stream.write_all(&batch)?;
                stream.flush()?;
                continue;
            }
            match stream.read(&mut asked) {
                Ok(0) => break,
                // What it may still send is `QUIT`; anything else is not served.
                Ok(n)
                    if asked[..n]
                        .to_ascii_lowercase()
                        .windows(4)
                        .any(|w| w == b"quit") =>
                {
                    stream.write_all(b"+OK\r\n")?;
                    break;
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Places the bytes of a request still arriving, `buf[pending]`, for what is known of
    /// it: where they must start for the argument arriving (a large value) to start on
    /// [`KvService::value_alignment`], so that its bytes go from there to a target read
    /// directly without a copy. In `buf` where it has room for the whole request there;
    /// else in room made for it all at once rather than grown (a copy each time) as its
    /// bytes come (fresh zeroed memory is the kernel's untouched pages, not a fill), no more
    /// than twice what has arrived or 16 MiB beyond it: announcing a value commits no more
    /// memory than that. Returns the buffer and where the bytes now start.
    fn place(&self, mut buf: Vec<u8>, pending: Range<usize>, a: Awaited) -> (Vec<u8>, usize) {
        let align = self.value_alignment();
        let head_in = |b: &[u8]| (align - (b.as_ptr() as usize + a.data) % align) % align;
        let head = head_in(&buf);
        if head + a.len <= buf.len() {
            buf.copy_within(pending, head);
            return (buf, head);
        }
        let arrived = pending.len();
        let mut room = vec![0; a.len.min((2 * arrived).max(arrived + (16 << 20))) + align];
        let head = head_in(&room);
        room[head..head + arrived].copy_from_slice(&buf[pending]);
        (room, head)
    }

    /// `first`, what `pick` took of a request, and what it takes of each complete request
    /// that follows in `input` from `end` on, up to the first it does not take; `end` is
    /// moved past those taken. Beside it, the command's name of the request the run ended
    /// at if that one has begun to arrive but is not whole.
    fn pipelined<'b, T>(
        &self,
        input: &'b [u8],
        end: &mut usize,
        args: &mut Vec<Range<usize>>,
        first: T,
        pick: impl Fn(&'b [u8], &[Range<usize>]) -> Option<T>,
    ) -> (Vec<T>, Option<&'b [u8]>) {
        let mut run = vec![first];
        loop {
            let rest = &input[*end..];
            // A run is of arrays: an inline command is served on its own.
            if resp::is_inline(rest) {
                return (run, None);
            }
            match resp::parse(rest, args, &mut Vec::new(), self.max_bulk()) {
                Ok(Some(m)) => {
                    let Some(taken) = pick(&rest[..m], args) else {
                        return (run, None);
                    };
                    run.push(taken);
                    *end += m;
                }
                Ok(None) => return (run, args.first().map(|r| &rest[r.clone()])),
                Err(_) => return (run, None),
            }
        }
    }

    /// Whether this service serves `key`: always, but on a node of a cluster only the keys
    /// of its slots.
    fn serves(&self, key: &[u8]) -> bool {
        self.cluster().is_none_or(|c| c.owns(key))
    }

    /// The cluster this service is a node of now, if it is one.
    fn cluster(&self) -> Option<Arc<cluster::Cluster>> {
        let cluster = self.cluster.read().unwrap_or_else(PoisonError::into_inner);
        cluster.clone()
    }

    /// The longest argument a request may carry: no value longer than the store, though
    /// at least what a command line takes.
    fn max_bulk(&self) -> usize {
        usize::try_from(self.config.capacity)
            .unwrap_or(usize::MAX)
            .max(resp::MAX_LINE)
    }
}

/// A connection's replies, sent from `from` on: the bytes before it are room left so that
/// a large value read from the target starts on a cache line (see [`Replies::align_value`]).
/// Everything else appends to the bytes as to any buffer.
#[derive(Debug)]
struct Replies {
    bytes: Vec<u8>,
    from: usize,
}

impl Replies {
    fn with_capacity(n: usize) -> Replies {
        Replies {
            bytes: Vec::with_capacity(n),
            from: 0,
        }
    }

    /// What is to be sent.
    fn pending(&self) -> &[u8] {
        &self.bytes[self.from..]
    }

    /// Sent: empty again, its room kept.
    fn clear(&mut self) {
        self.bytes.clear();
        self.from = 0;
    }

    /// Before the first reply, when it is a value of `len` bytes to be read from the
    /// target: room for the whole reply at once, and the reply started where the value's
    /// first byte is at a multiple of `align` (a power of two). The kernel's copy from the
    /// target's socket into a destination off a cache line took three times as long
    /// (docs/benchmarks.md, "The KV-cache service": a value's place in its reply); a
    /// device read directly reads into the reply itself when it is sector-aligned.
    fn align_value(&mut self, len: usize, align: usize) {
        if !self.bytes.is_empty() {
            return;
        }
        let header = reply::bulk_header_len(len);
        self.bytes.reserve(align + header + len + 2);
        let value_at = self.bytes.as_ptr() as usize + header;
        self.from = (align - value_at % align) % align;
        self.bytes.resize(self.from, 0);
    }
}

impl Deref for Replies {
    type Target = Vec<u8>;

    fn deref(&self) -> &Vec<u8> {
        &self.bytes
    }
}

impl DerefMut for Replies {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.bytes
    }
}

#[cfg(test)]
mod tests;
