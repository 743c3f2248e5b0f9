//! The KV-cache service: a Redis-protocol server whose values are stored on the storage
//! target in whole blocks, with the index in memory. A thread accepts connections and a
//! thread serves each one; requests on a connection may be pipelined and are answered in
//! order. Values move between the connection and the target without passing through
//! the index, which is locked only to look up, allocate and publish.

use super::glob;
use super::index::{Extents, Index, IndexStats, Run, SnapshotDraft, StoreError, SNAPSHOT_PART};
use super::persist::{self, Layout, Saved};
use super::resp::{self, reply, Awaited};
use super::storage::{self, BlockTarget, Pool, TargetError};
use crate::ir::{KvCache, StorageTarget};
use crc32c::crc32c;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};
use std::time::{Duration, Instant};

/// Client connections served at once; more are answered with an error and closed.
pub const MAX_CLIENTS: u64 = 1024;
/// A client connection's read buffer, and its reply buffer, while the client is quiet.
const READ_BUFFER: usize = 64 << 10;
/// The boundary a large value read from the target is placed on in its reply.
const CACHE_LINE: usize = 64;
/// The values read for a connection's replies before they are sent: an `MGET` of many
/// large values, or a deep pipeline of `GET`s, is answered a share at a time, so what it
/// holds is bounded by this (and one value), not by how many keys the client asked for.
const REPLY_SHARE: usize = 64 << 20;
/// Values kept in memory written to the target in one run when the service stops.
const INLINE_WRITES: usize = 256;
/// With checkpoints, keys leave this share of the store's blocks free (a sixteenth) for
/// the values written between two checkpoints, as the blocks of values removed meanwhile
/// are held back.
const CHECKPOINT_RESERVE: u64 = 16;
/// How often blocked threads look at the stop flag.
const POLL: Duration = Duration::from_millis(200);
/// How long a checkpoint leaves the index to requests between the parts it copies.
const SNAPSHOT_PAUSE: Duration = Duration::from_micros(50);
/// Deltas the superblock names after a snapshot at most (each takes 32 bytes of it, more
/// if its blocks are not in one run; a 512-byte block holds thirteen).
const MAX_DELTAS: usize = 8;

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
        source: Box<super::tls::TlsError>,
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

/// The commands counted by name; any other is counted as `other`.
pub const COMMANDS: &[&str] = &[
    "get", "set", "mget", "mset", "del", "exists", "strlen", "dbsize", "flushall", "ping", "info",
    "expire", "ttl", "persist", "other",
];

/// A target's saved index as read, nothing written: its first block, the superblock
/// decoded from it, and the index it names.
struct SavedRead {
    first: Vec<u8>,
    superblock: Result<persist::Superblock, persist::Unusable>,
    index: Result<Index, persist::Unusable>,
}

/// Reads the index saved on `t` for a store laid out as `layout`.
fn read_saved(t: &mut dyn BlockTarget, layout: &Layout) -> io::Result<SavedRead> {
    let bs = layout.block_size;
    let mut first = vec![0u8; bs as usize];
    t.read_at(0, &mut first)?;
    let sb = persist::Superblock::decode(&first);
    let blocks = layout.capacity / bs;
    let index = match &sb {
        // Runs outside the store, or more of them than it has blocks (a damaged
        // superblock whose checksum still held): refused before anything is read.
        Ok(sb)
            if sb
                .segments()
                .flat_map(|s| &s.runs)
                .any(|&(b, n)| b.checked_add(n).is_none_or(|e| e > blocks))
                || sb
                    .segments()
                    .flat_map(|s| &s.runs)
                    .map(|r| r.1)
                    .sum::<u64>()
                    > blocks =>
        {
            Err(persist::Unusable::Snapshot)
        }
        Ok(sb) => {
            // The snapshot and each delta, read from their runs.
            let mut read: Vec<Vec<u8>> = sb
                .segments()
                .map(|s| vec![0u8; (s.runs.iter().map(|r| r.1).sum::<u64>() * bs) as usize])
                .collect();
            let mut pieces = Vec::new();
            for (segment, bytes) in sb.segments().zip(&mut read) {
                pieces.extend(run_pieces(segment.runs.iter().copied(), bs, bytes));
            }
            t.read_many(&mut pieces)?;
            let deltas: Vec<&[u8]> = read[1..].iter().map(|d| &d[..]).collect();
            persist::load(sb, &read[0], &deltas, layout)
        }
        Err(why) => Err(why.clone()),
    };
    Ok(SavedRead {
        first,
        superblock: sb,
        index,
    })
}

/// `bytes` as the pieces that `runs` of blocks of `bs` bytes read into, in order: each the
/// run's offset on the target and its part of `bytes`.
fn run_pieces(runs: impl Iterator<Item = Run>, bs: u64, bytes: &mut [u8]) -> Vec<(u64, &mut [u8])> {
    let mut rest = bytes;
    runs.map(|(block, n)| {
        let (piece, after) = std::mem::take(&mut rest).split_at_mut((n * bs) as usize);
        rest = after;
        (block * bs, piece)
    })
    .collect()
}

/// The values a start dropped because the targets they lie on do not hold them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strangers {
    /// The targets, as [`storage::describe`] names them.
    pub targets: Vec<String>,
    /// How many values lay on them.
    pub values: usize,
}

impl std::fmt::Display for Strangers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} do not hold the values the saved index puts on them (values read back fail \
             their checksums: another store's drive or a blank one in their place); the {} \
             values with a block on them are dropped",
            self.targets.join(", "),
            self.values
        )
    }
}

/// Drops from `index`, just loaded from a store laid out as `layout` over `targets`
/// (reached through `t`), the values on targets that do not hold what it says they hold
/// ([`persist::strangers`]), and says which: when a striped store's target is replaced,
/// its values go at the start, where they would otherwise be found corrupt one read at a
/// time.
fn drop_strangers(
    index: &mut Index,
    t: &mut dyn BlockTarget,
    layout: &Layout,
    targets: &[StorageTarget],
) -> Option<Strangers> {
    let bs = layout.block_size;
    let strangers = persist::strangers(index, layout, |e| {
        let mut bytes = vec![0u8; (e.runs().map(|r| r.1).sum::<u64>() * bs) as usize];
        t.read_many(&mut run_pieces(e.runs(), bs, &mut bytes))
            .ok()?;
        Some(e.checksum() == Some(crc32c(&bytes[..e.len() as usize])))
    });
    if strangers.is_empty() {
        return None;
    }
    let mut flags = vec![false; targets.len()];
    for &s in &strangers {
        flags[s] = true;
    }
    Some(Strangers {
        values: index.remove_where(|e| persist::lies_on(layout, e, &flags)),
        targets: strangers
            .iter()
            .map(|&s| storage::describe(&targets[s]))
            .collect(),
    })
}

/// What a service's target holds for its next start (`dpuflow kv inspect`).
#[derive(Debug)]
pub struct Inspection {
    /// The saved index's superblock: how and in what layout it was saved, its snapshot
    /// and deltas.
    pub superblock: Result<persist::Superblock, persist::Unusable>,
    /// What the index it names holds, or why a start would not use it.
    pub index: Result<IndexStats, persist::Unusable>,
    /// The values a start would drop as they are not on their targets.
    pub strangers: Option<Strangers>,
}

/// Reads the index saved on `config`'s target, writing nothing: what its next start would
/// restore. A local file that does not exist is an error here, not created.
pub fn inspect(config: &KvCache) -> Result<Inspection, TargetError> {
    for target in &config.targets {
        if let StorageTarget::Local { path } = target {
            if !path.exists() {
                return Err(TargetError::Open {
                    target: storage::describe(target),
                    source: io::Error::new(
                        io::ErrorKind::NotFound,
                        "no such file (the service makes it at its first start)",
                    ),
                });
            }
        }
    }
    let mut t = storage::connect_store(config, &storage::Failures::of(&config.targets))?;
    let layout = Layout::of(config);
    let read = read_saved(t.as_mut(), &layout).map_err(|source| TargetError::Open {
        target: storage::describe_all(&config.targets),
        source,
    })?;
    let mut strangers = None;
    let index = read.index.map(|mut index| {
        strangers = drop_strangers(&mut index, t.as_mut(), &layout, &config.targets);
        index.stats()
    });
    Ok(Inspection {
        superblock: read.superblock,
        index,
        strangers,
    })
}

/// What a start restored, beside the index: with checkpoints, the blocks of the save it
/// was restored from, kept while the target's superblock names them, and that superblock
/// when the next checkpoint may be a delta on it (its layout is this build's).
type Restored = Option<(Extents, Option<persist::Superblock>)>;

/// The index saved on `pool`'s target, if there is one for this store; empty otherwise.
/// With checkpoints, what a saved index names is held back from then on, its snapshot's
/// blocks kept (returned beside it) and its superblock left as it is; without, the
/// superblock is marked taken before anything is written (see [`persist`]).
fn saved_index(name: &str, config: &KvCache, pool: &Pool) -> io::Result<(Index, Restored)> {
    let (capacity, bs) = (config.capacity, config.block_size);
    let loaded = pool.with(|t| {
        let layout = Layout::of(config);
        let SavedRead {
            first,
            superblock: sb,
            index,
        } = read_saved(t, &layout)?;
        let loaded = index.map(|mut index| {
            if let Some(strangers) = drop_strangers(&mut index, t, &layout, &config.targets) {
                tracing::warn!(service = name, "kvcache targets {strangers}");
            }
            // With checkpoints, the snapshot's blocks are kept while its superblock names them.
            let kept = match (&sb, config.checkpoint) {
                (Ok(sb), Some(_)) => {
                    let runs: Vec<_> = sb.segments().flat_map(|s| s.runs.iter().copied()).collect();
                    let last = sb.is_current().then(|| sb.clone());
                    index.take_runs(&runs).map(|kept| (kept, last))
                }
                _ => None,
            };
            (index, kept, sb.as_ref().map(|sb| sb.saved).ok())
        });
        match (&sb, &loaded) {
            (Ok(_), Ok((_, Some(_), _))) | (Err(persist::Unusable::Missing), _) => {}
            (Ok(_), _) => t.write_at(0, &persist::Superblock::taken(&first))?,
            (Err(_), _) => t.write_at(0, &vec![0u8; bs as usize])?,
        }
        Ok(loaded)
    });
    let (mut index, kept) = match loaded? {
        Ok((index, kept, saved)) => {
            let from = match saved {
                Some(Saved::Checkpoint) => "checkpoint",
                _ => "clean stop",
            };
            tracing::info!(
                service = name,
                keys = index.stats().keys,
                saved_at = from,
                "kvcache index restored"
            );
            (index, kept)
        }
        Err(persist::Unusable::Missing) => (Index::new(capacity, bs), None),
        Err(why) => {
            // A saved index given up is a cache lost: said as a warning.
            tracing::warn!(service = name, %why, "kvcache starts empty");
            (Index::new(capacity, bs), None)
        }
    };
    if config.checkpoint.is_some() {
        index.hold_back(capacity / bs / CHECKPOINT_RESERVE);
    }
    Ok((index, kept))
}

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

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// A client connection, counted in `clients` while it lives: uncounted when its thread
/// ends, however it ends (a bug's panic included), so the count cannot creep up to
/// [`MAX_CLIENTS`] and lock everyone out.
struct Client(Arc<KvService>);

impl Client {
    fn count(svc: Arc<KvService>) -> Client {
        svc.counters.clients.fetch_add(1, Relaxed);
        Client(svc)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.0.counters.clients.fetch_sub(1, Relaxed);
    }
}

/// When a `SET` stores: always, or only if the key is absent (`NX`) or present (`XX`).
#[derive(Debug, Clone, Copy)]
enum Only {
    Any,
    Absent,
    Present,
}

impl Only {
    fn allows(self, held: bool) -> bool {
        match self {
            Only::Any => true,
            Only::Absent => !held,
            Only::Present => held,
        }
    }
}

/// What a `SET` does to the key's deadline: takes it away (the default), keeps it
/// (`KEEPTTL`), or sets one (unix milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Clear,
    Keep,
    At(i64),
}

/// The time of day in unix milliseconds, the clock deadlines are in.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// An integer argument as Redis reads one: an optional minus and digits, no leading zero,
/// within 64 bits.
fn integer(arg: &[u8]) -> Option<i64> {
    let digits = arg.strip_prefix(b"-").unwrap_or(arg);
    let canonical = match digits {
        [] => false,
        [b'0'] => digits.len() == arg.len(),
        [first, ..] => *first != b'0' && digits.iter().all(u8::is_ascii_digit),
    };
    canonical
        .then(|| std::str::from_utf8(arg).ok()?.parse().ok())
        .flatten()
}

/// The deadline (unix milliseconds) `amount` of `unit` gives at `now`: relative for
/// `EX`/`PX`/`EXPIRE`/`PEXPIRE`, absolute for the `…AT` forms; `None` past 64 bits
/// (Redis's "invalid expire time").
fn deadline_of(amount: i64, seconds: bool, relative: bool, now: i64) -> Option<i64> {
    let ms = if seconds {
        amount.checked_mul(1000)?
    } else {
        amount
    };
    if relative {
        ms.checked_add(now)
    } else {
        Some(ms)
    }
}

/// What an expiry option of `SET` or `GETEX` (lower case) counts in: (seconds, relative to
/// now), for `EX`, `PX`, `EXAT` and `PXAT`.
fn expiry_unit(option: &[u8]) -> Option<(bool, bool)> {
    match option {
        b"ex" => Some((true, true)),
        b"px" => Some((false, true)),
        b"exat" => Some((true, false)),
        b"pxat" => Some((false, false)),
        _ => None,
    }
}

/// The deadline an expiry option's `amount` in `unit` ([`expiry_unit`]) gives at `now`, or
/// Redis's error for `command`: the amount must be a positive integer within 64 bits.
fn option_deadline(
    command: &str,
    (seconds, relative): (bool, bool),
    amount: &[u8],
    now: i64,
) -> Result<i64, String> {
    let amount = integer(amount).ok_or("ERR value is not an integer or out of range")?;
    deadline_of(amount, seconds, relative, now)
        .filter(|_| amount > 0)
        .ok_or_else(|| format!("ERR invalid expire time in '{command}' command"))
}

/// The reply to a value the store cannot take.
fn refusal(e: &StoreError) -> String {
    match e {
        StoreError::TooLarge { .. } => format!("ERR {e}"),
        // Redis's answer when a write finds no room.
        StoreError::Busy => format!("OOM {e}"),
    }
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

/// The key and value of a `SET key value` request (no options).
fn set_of<'a>(req: &'a [u8], args: &[Range<usize>]) -> Option<(&'a [u8], &'a [u8])> {
    match args {
        [name, key, value] if req[name.clone()].eq_ignore_ascii_case(b"set") => {
            Some((&req[key.clone()], &req[value.clone()]))
        }
        _ => None,
    }
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

/// What the service counts, for metrics and INFO.
#[derive(Debug, Default)]
pub struct KvCounters {
    pub commands: [AtomicU64; COMMANDS.len()],
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
    pub rejected_clients: AtomicU64,
    /// `AUTH` (or `HELLO … AUTH`) with a wrong password.
    pub auth_failures: AtomicU64,
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

/// The save the target's superblock names, while checkpoints are taken.
#[derive(Debug, Default)]
struct Checkpoints {
    /// The blocks of its snapshot and deltas, kept.
    kept: Vec<Extents>,
    /// [`Index::changes`] when it was taken.
    changes: Option<u64>,
    /// What its superblock names, when this run wrote it and the next checkpoint may be a
    /// delta on it.
    names: Option<persist::Superblock>,
    /// The keys its snapshot held.
    snapshot_keys: u64,
    /// [`super::index::IndexStats::hold_back_overruns`] when it began.
    overruns: u64,
}

impl Checkpoints {
    /// Whether a checkpoint of the `changed` keys is to be a delta: while the deltas
    /// together stay under half the snapshot they follow (and are few), a delta writes
    /// less; past that a load would apply more than the snapshot it reads, and a whole
    /// snapshot starts afresh. So it does after an overrun (`overruns` moved since the
    /// last began): values may then have taken blocks of keys the saves name still, which
    /// only a whole snapshot says afresh.
    fn delta_next(&self, changed: &[Arc<[u8]>], overruns: u64) -> bool {
        let Some(names) = &self.names else {
            return false;
        };
        if overruns != self.overruns {
            return false;
        }
        let per_key = names.snapshot.len / self.snapshot_keys.max(1);
        let deltas: u64 = names.deltas.iter().map(|d| d.len).sum();
        names.deltas.len() < MAX_DELTAS
            && deltas + per_key * changed.len() as u64 <= names.snapshot.len / 2
    }
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
    /// The order `SCAN` visits keys in.
    scan_order: RandomState,
    /// What clients must give `AUTH` before anything else, if anything.
    password: Option<Vec<u8>>,
    /// TLS on every connection, when configured.
    tls: Option<Arc<rustls::ServerConfig>>,
    /// Keys the start restored from the index saved on the target.
    pub restored_keys: u64,
    checkpoints: Mutex<Checkpoints>,
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
        let tls = match &config.tls {
            Some(files) => {
                Some(
                    super::tls::server_config(files).map_err(|source| StartError::Tls {
                        service: name.to_owned(),
                        source: Box::new(source),
                    })?,
                )
            }
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
        let restored_keys = index.stats().keys;
        if config.discard {
            index.discard_freed();
        }
        let (kept, names) = kept.map_or((None, None), |(kept, last)| (Some(kept), last));
        if names.is_some() {
            // From here every change is noted: the first checkpoint may be a delta on the
            // save restored, rather than the whole index again.
            drop(index.take_changed());
        }
        let checkpoints = Checkpoints {
            changes: kept.as_ref().map(|_| index.changes()),
            kept: kept.into_iter().collect(),
            snapshot_keys: restored_keys,
            names,
            ..Checkpoints::default()
        };
        let listener = TcpListener::bind(config.listen).map_err(|source| StartError::Listen {
            service: name.to_owned(),
            addr: config.listen,
            source,
        })?;
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
            scan_order: RandomState::new(),
            password,
            tls,
            restored_keys,
            checkpoints: Mutex::new(checkpoints),
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
        // After any checkpoint under way.
        let _checkpoints = self
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
    }

    /// Tells the target of the blocks freed, every [`POLL`] until the service stops, before
    /// they are used again (`discard on`). A failed discard is counted and logged, and its
    /// blocks are used all the same: it would only have helped the target.
    fn discard_freed_blocks(self: Arc<Self>) {
        let mut failure_warning = crate::telemetry::WarnThrottle::default();
        let block = self.config.block_size;
        while !self.stop.load(Relaxed) {
            std::thread::sleep(POLL);
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

    /// Saves the index every `every` until the service stops, if it changed.
    fn take_checkpoints(self: Arc<Self>, every: Duration) {
        let mut last = Instant::now();
        let mut failure_warning = crate::telemetry::WarnThrottle::default();
        while !self.stop.load(Relaxed) {
            std::thread::sleep(POLL);
            if last.elapsed() < every || self.stop.load(Relaxed) {
                continue;
            }
            last = Instant::now();
            match self.checkpoint() {
                Ok(_) => {}
                Err(e) => {
                    self.counters.checkpoint_failures.fetch_add(1, Relaxed);
                    if failure_warning.ready() {
                        tracing::warn!(service = %self.name, error = %e, "kvcache checkpoint failed: the target keeps the one before");
                    }
                }
            }
        }
    }

    /// Saves the index as a checkpoint, unless nothing changed since the last; whether it
    /// did: the keys changed since the last as a delta on it while deltas stay small, the
    /// whole index otherwise. The index is locked only to copy it, [`SNAPSHOT_PART`] keys
    /// at a time, and to take free blocks for the copy: the values kept in memory are
    /// written and the copy and the superblock after them, while requests go on.
    fn checkpoint(&self) -> io::Result<bool> {
        let mut checkpoints = self
            .checkpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut index = self.lock();
        let changes = index.changes();
        if checkpoints.changes == Some(changes) {
            return Ok(false);
        }
        // From here blocks freed are held back, so every record copied stays true.
        let released = index.begin_save();
        let overruns = index.stats().hold_back_overruns;
        // The keys changed, if not the delta's, are dropped once the index is unlocked.
        let changed = index.take_changed();
        let (mut draft, unused) = match changed.complete {
            true if checkpoints.delta_next(&changed.keys, overruns) => {
                (index.start_delta(changed.keys), None)
            }
            _ => (index.start_snapshot(), Some(changed)),
        };
        // A copy chasing keys used faster than it copies is finished under one lock.
        let most_parts = 2 * (index.stats().keys / SNAPSHOT_PART as u64) + 2;
        loop {
            let most = match draft.parts() < most_parts {
                true => SNAPSHOT_PART,
                false => usize::MAX,
            };
            if index.snapshot_part(&mut draft, most) {
                break;
            }
            drop(index);
            // Requests waiting for the lock take it before the next part does.
            std::thread::sleep(SNAPSHOT_PAUSE);
            index = self.lock();
        }
        let keys = index.stats().keys;
        drop(index);
        drop(unused);
        let delta = draft.is_delta();
        let written = self.save_snapshot(draft, checkpoints.names.as_ref());
        let mut index = self.lock();
        match written {
            Ok(save) => {
                index.release(released);
                if delta {
                    checkpoints.kept.push(save.blocks);
                } else {
                    // The snapshot and deltas before are no longer named; their blocks
                    // are held back in turn.
                    checkpoints.kept = vec![save.blocks];
                    checkpoints.snapshot_keys = keys;
                }
                checkpoints.names = Some(save.names);
                checkpoints.overruns = overruns;
                checkpoints.changes = Some(changes);
                self.counters.changes_at_last_save.store(changes, Relaxed);
                self.counters.last_save_failed.store(false, Relaxed);
                self.counters.checkpoints.fetch_add(1, Relaxed);
                let deltas = u64::from(delta);
                self.counters.checkpoint_deltas.fetch_add(deltas, Relaxed);
                self.counters
                    .checkpoint_bytes
                    .fetch_add(save.snapshot.len() as u64, Relaxed);
                let now = u64::try_from(now_ms()).unwrap_or(0);
                self.counters.last_save_ms.store(now, Relaxed);
                Ok(true)
            }
            Err(e) => {
                index.hold_again(released);
                // The next is whole, as the keys changed before this one began are not
                // noted any more (and a delta may have failed for want of room in the
                // superblock, and would again).
                checkpoints.names = None;
                self.counters.last_save_failed.store(true, Relaxed);
                Err(e)
            }
        }
    }

    /// Writes a checkpoint's snapshot or delta (on what `last` names): free blocks for
    /// it (the index locked for that), the values kept in memory it names, then the copy
    /// and the superblock.
    fn save_snapshot(
        &self,
        draft: SnapshotDraft,
        last: Option<&persist::Superblock>,
    ) -> io::Result<persist::Save> {
        if draft.is_torn() {
            return Err(io::Error::other(
                "values took the blocks held back for it while the index was copied (an overrun)",
            ));
        }
        let inline = draft.inline_unwritten().to_vec();
        let delta = draft.is_delta();
        let snapshot = draft.encode();
        let blocks = self.lock().take_free(snapshot.len() as u64);
        let blocks = blocks
            .ok_or_else(|| io::Error::other("too few free blocks for the index's snapshot"))?;
        let save = match (delta, last) {
            (true, Some(last)) => persist::seal_delta(last, snapshot, blocks),
            _ => persist::seal(
                snapshot,
                blocks,
                &Layout::of(&self.config),
                Saved::Checkpoint,
            ),
        };
        let save =
            save.ok_or_else(|| io::Error::other("the snapshot's blocks are in too many runs"))?;
        self.write_inline(&inline)?;
        self.write_save(&save)?;
        Ok(save)
    }

    /// `SAVE`: a checkpoint now, answered once it is durable (or the index has not changed
    /// since the last), as Redis's `SAVE` answers once its RDB file is written.
    fn save_command(&self, out: &mut Vec<u8>) {
        if self.config.checkpoint.is_none() {
            reply::error(
                out,
                "ERR checkpoints are off for this service (checkpoint off): the index is saved at a clean stop",
            );
            return;
        }
        match self.checkpoint() {
            Ok(_) => reply::ok(out),
            Err(e) => {
                self.counters.checkpoint_failures.fetch_add(1, Relaxed);
                tracing::warn!(service = %self.name, error = %e, "kvcache checkpoint (SAVE) failed: the target keeps the one before");
                reply::error(out, &format!("ERR checkpoint failed: {e}"));
            }
        }
    }

    /// Writes the values kept in memory among `values` that are not on their blocks yet.
    fn write_inline(&self, values: &[Arc<Extents>]) -> io::Result<()> {
        let unwritten: Vec<_> = values.iter().filter(|e| e.inline_unwritten()).collect();
        for chunk in unwritten.chunks(INLINE_WRITES) {
            let pieces: Vec<_> = chunk
                .iter()
                .filter_map(|e| Some((&***e, e.inline()?)))
                .collect();
            self.write_values(&pieces)?;
            chunk.iter().for_each(|e| e.set_inline_written());
        }
        Ok(())
    }

    /// Writes a save: its snapshot, then its superblock once the values and the snapshot
    /// are durable (a superblock naming blocks a power loss took would serve wrong bytes),
    /// made durable itself.
    fn write_save(&self, save: &persist::Save) -> io::Result<()> {
        let bs = self.config.block_size;
        self.pool
            .with(|t| {
                let mut pieces = Vec::new();
                let mut at = 0usize;
                for (first, n) in save.blocks.runs() {
                    let len = (n * bs) as usize;
                    pieces.push((first * bs, &save.snapshot[at..at + len]));
                    at += len;
                }
                t.write_many(&pieces)
            })
            .and_then(|()| self.pool.flush_all())
            .and_then(|()| self.pool.with(|t| t.write_at(0, &save.superblock)))
            .and_then(|()| self.pool.flush_all())
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

    /// The index, without the keys whose deadline has passed: every command sees only
    /// live keys, and their blocks are free again before a value needs room.
    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        let mut ix = self.index.lock().unwrap_or_else(PoisonError::into_inner);
        ix.purge_expired(u64::try_from(now_ms()).unwrap_or(0));
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
            match acceptor.accept(POLL) {
                Ok(None) => {}
                Ok(Some((stream, peer))) => {
                    if self.counters.clients.load(Relaxed) >= MAX_CLIENTS {
                        self.counters.rejected_clients.fetch_add(1, Relaxed);
                        let mut s = stream;
                        let _ = s.write_all(b"-ERR max number of clients reached\r\n");
                        continue;
                    }
                    let client = Client::count(Arc::clone(&self));
                    let spawned = std::thread::Builder::new()
                        .name(format!("kv-{}-client", self.name))
                        .spawn(move || {
                            if let Err(e) = client.0.serve(stream) {
                                tracing::debug!(service = %client.0.name, %peer, error = %e, "kvcache client gone");
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
    fn serve(&self, stream: TcpStream) -> io::Result<()> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(POLL))?;
        match &self.tls {
            Some(config) => {
                let conn =
                    rustls::ServerConnection::new(Arc::clone(config)).map_err(io::Error::other)?;
                let talked = self.talk(rustls::StreamOwned::new(conn, stream));
                // rustls reports what breaks TLS as invalid data.
                if talked
                    .as_ref()
                    .is_err_and(|e| e.kind() == io::ErrorKind::InvalidData)
                {
                    self.counters.tls_failures.fetch_add(1, Relaxed);
                }
                talked
            }
            None => self.talk(stream),
        }
    }

    /// The requests and replies of one client's connection.
    fn talk(&self, mut stream: impl Read + Write) -> io::Result<()> {
        // Bytes read are `buf[head..filled]`; the rest is room, zeroed once when it grows
        // (not on every read: most reads are small requests). `head` is where a large
        // value's request starts so that the value lands aligned (see `place`).
        let mut buf: Vec<u8> = vec![0; READ_BUFFER];
        let (mut head, mut filled) = (0, 0);
        let mut authed = self.password.is_none();
        // The client has sent all it will (what is whole is still served).
        let mut closed = false;
        let mut args: Vec<Range<usize>> = Vec::new();
        let mut out = Replies::with_capacity(READ_BUFFER);
        loop {
            let mut start = head;
            let mut quit = false;
            // The length, from `start`, the requests waited for will have at least, and
            // where in them the argument arriving starts, where known (a large value's
            // length arrives before its bytes).
            let mut awaited = None;
            while !quit {
                match resp::parse(&buf[start..filled], &mut args, self.max_bulk()) {
                    Ok(Some(n)) => {
                        let req = &buf[start..start + n];
                        // GETs and SETs the client pipelined, as many of one kind as
                        // are here in a row, go to the target together, as an MGET's
                        // values and an MSET's do.
                        let mut end = start + n;
                        let input = &buf[..filled];
                        if let Some(key) = get_of(req, &args).filter(|_| authed) {
                            let (keys, _) = self.pipelined(input, &mut end, &mut args, key, get_of);
                            let since = Instant::now();
                            self.values_in_shares(&keys, &mut out, &mut stream)?;
                            self.count_run("get", keys.len(), since);
                            start = end;
                            continue;
                        }
                        if let Some(keys) = mget_of(req, &args).filter(|_| authed) {
                            self.count("mget");
                            reply::array(&mut out, keys.len());
                            self.values_in_shares(&keys, &mut out, &mut stream)?;
                            start = end;
                            continue;
                        }
                        if let Some(item) = set_of(req, &args).filter(|_| authed) {
                            let (items, arriving) =
                                self.pipelined(input, &mut end, &mut args, item, set_of);
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
                            self.sets(&items, &mut out);
                            start = end;
                            continue;
                        }
                        let words: Vec<&[u8]> = args.iter().map(|r| &req[r.clone()]).collect();
                        quit = if authed {
                            self.execute(&words, &mut out)
                        } else {
                            self.unauthenticated(&words, &mut out, &mut authed)
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
            if !out.is_empty() {
                send(&mut stream, &mut out)?;
            }
            if quit || self.stop.load(Relaxed) {
                return Ok(());
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
            match stream.read(&mut buf[filled..]) {
                Ok(0) if closed || filled == head => return Ok(()),
                Ok(0) => closed = true,
                Ok(n) => filled += n,
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
            match resp::parse(rest, args, self.max_bulk()) {
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

    /// The longest argument a request may carry: no value longer than the store, though
    /// at least what a command line takes.
    fn max_bulk(&self) -> usize {
        usize::try_from(self.config.capacity)
            .unwrap_or(usize::MAX)
            .max(resp::MAX_LINE)
    }

    fn count(&self, command: &str) {
        self.count_n(command, 1);
    }

    /// Counts `n` requests of `command`.
    fn count_n(&self, command: &str, n: u64) {
        // The forms of a command are counted as one.
        let command = match command {
            "getdel" | "getex" => "get",
            "pexpire" | "expireat" | "pexpireat" => "expire",
            "pttl" | "expiretime" | "pexpiretime" => "ttl",
            c => c,
        };
        let i = COMMANDS
            .iter()
            .position(|c| *c == command)
            .unwrap_or(COMMANDS.len() - 1);
        self.counters.commands[i].fetch_add(n, Relaxed);
    }

    /// Runs one request, appending its reply to `out`; `true` when the client asked to
    /// leave.
    fn execute(&self, words: &[&[u8]], out: &mut Replies) -> bool {
        let Some((name, args)) = words.split_first() else {
            return false;
        };
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let arity = |n: usize, out: &mut Vec<u8>| {
            let ok = args.len() == n;
            if !ok {
                reply::error(
                    out,
                    &format!("ERR wrong number of arguments for '{name}' command"),
                );
            }
            ok
        };
        self.count(&name);
        let timed = TIMED.iter().position(|c| *c == name);
        let since = timed.map(|_| Instant::now());
        match name.as_str() {
            "get" => {
                if arity(1, out) {
                    self.get(args[0], out);
                }
            }
            "set" => self.set_command(args, out),
            "getdel" => {
                if arity(1, out) {
                    self.getdel(args[0], out);
                }
            }
            "getex" => self.getex(args, out),
            "mset" if !args.is_empty() && args.len() % 2 == 0 => {
                let pairs: Vec<_> = args.chunks(2).map(|kv| (kv[0], kv[1])).collect();
                let failed = self
                    .store_all(&pairs)
                    .into_iter()
                    .rev()
                    .find_map(Result::err);
                match failed {
                    None => reply::ok(out),
                    Some(e) => reply::error(out, &e),
                }
            }
            "del" | "unlink" if !args.is_empty() => {
                let mut ix = self.lock();
                let n = args.iter().filter(|k| ix.remove(k)).count();
                reply::integer(out, n as i64);
            }
            "exists" if !args.is_empty() => {
                let ix = self.lock();
                let n = args.iter().filter(|k| ix.contains(k)).count();
                reply::integer(out, n as i64);
            }
            "strlen" => {
                if arity(1, out) {
                    let len = self.lock().len_of(args[0]).unwrap_or(0);
                    reply::integer(out, len as i64);
                }
            }
            "dbsize" => reply::integer(out, self.lock().stats().keys as i64),
            "expire" | "pexpire" | "expireat" | "pexpireat" => self.expire(&name, args, out),
            "ttl" | "pttl" | "expiretime" | "pexpiretime" => {
                if arity(1, out) {
                    self.ttl(&name, args[0], out);
                }
            }
            "persist" => {
                if arity(1, out) {
                    let mut ix = self.lock();
                    let had = matches!(ix.deadline(args[0]), Some(Some(_)));
                    if had {
                        ix.set_deadline(args[0], None);
                    }
                    reply::integer(out, i64::from(had));
                }
            }
            "keys" => {
                if arity(1, out) {
                    let ix = self.lock();
                    let keys: Vec<&[u8]> =
                        ix.keys().filter(|k| glob::matches(args[0], k)).collect();
                    reply::array(out, keys.len());
                    for k in keys {
                        reply::bulk(out, k);
                    }
                }
            }
            "scan" => self.scan(args, out),
            "flushall" | "flushdb" => {
                self.lock().clear();
                reply::ok(out);
            }
            "save" => {
                if arity(0, out) {
                    self.save_command(out);
                }
            }
            "lastsave" => {
                if arity(0, out) {
                    let ms = self.counters.last_save_ms.load(Relaxed);
                    reply::integer(out, i64::try_from(ms / 1000).unwrap_or(i64::MAX));
                }
            }
            "ping" => match args {
                [] => reply::simple(out, "PONG"),
                [msg] => reply::bulk(out, msg),
                _ => {
                    arity(1, out);
                }
            },
            "echo" => {
                if arity(1, out) {
                    reply::bulk(out, args[0]);
                }
            }
            "quit" => {
                reply::ok(out);
                return true;
            }
            "select" => match args {
                [b"0"] => reply::ok(out),
                [_] => reply::error(out, "ERR DB index is out of range"),
                _ => {
                    arity(1, out);
                }
            },
            "info" => reply::bulk(out, self.info().as_bytes()),
            "config" => self.config_command(args, out),
            "command" => match args.first().map(|a| a.to_ascii_lowercase()) {
                Some(sub) if sub == b"count" => reply::integer(out, COMMANDS.len() as i64 + 8),
                _ => reply::array(out, 0),
            },
            "client" => match args.first().map(|a| a.to_ascii_lowercase()).as_deref() {
                Some(b"setname" | b"setinfo") => reply::ok(out),
                Some(b"getname") => reply::null(out),
                _ => reply::error(out, "ERR unknown subcommand for 'client'"),
            },
            "auth" => match self.auth(args) {
                Ok(()) => reply::ok(out),
                Err(e) => reply::error(out, e),
            },
            "hello" => {
                let _ = self.hello_command(args, out);
            }
            "mget" | "mset" | "del" | "unlink" | "exists" => {
                reply::error(
                    out,
                    &format!("ERR wrong number of arguments for '{name}' command"),
                );
            }
            _ => {
                let first = args
                    .first()
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .unwrap_or_default();
                reply::error(
                    out,
                    &format!("ERR unknown command '{name}', with args beginning with: '{first}'"),
                );
            }
        }
        if let (Some(i), Some(since)) = (timed, since) {
            self.counters.durations[i].observe(since.elapsed());
        }
        false
    }

    /// `SET key value [NX | XX] [GET] [EX s | PX ms | EXAT unix-s | PXAT unix-ms | KEEPTTL]`,
    /// as Redis 7 reads it: a deadline already passed stores nothing and removes the key.
    fn set_command(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        let [key, value, opts @ ..] = args else {
            reply::error(out, "ERR wrong number of arguments for 'set' command");
            return;
        };
        let (mut only, mut expiry, mut get) = (None, None, false);
        let mut opts = opts.iter();
        while let Some(o) = opts.next() {
            let o = o.to_ascii_lowercase();
            let (seconds, relative) = match o.as_slice() {
                b"get" => {
                    get = true;
                    continue;
                }
                b"nx" | b"xx" if only.is_none() => {
                    only = Some(if o == b"nx" {
                        Only::Absent
                    } else {
                        Only::Present
                    });
                    continue;
                }
                b"keepttl" if expiry.is_none() => {
                    expiry = Some(Expiry::Keep);
                    continue;
                }
                o => match expiry_unit(o) {
                    Some(unit) => unit,
                    None => {
                        reply::error(out, "ERR syntax error");
                        return;
                    }
                },
            };
            let Some(amount) = opts.next().filter(|_| expiry.is_none()) else {
                reply::error(out, "ERR syntax error");
                return;
            };
            match option_deadline("set", (seconds, relative), amount, now_ms()) {
                Ok(at) => expiry = Some(Expiry::At(at)),
                Err(e) => {
                    reply::error(out, &e);
                    return;
                }
            }
        }
        let only = only.unwrap_or(Only::Any);
        let expiry = expiry.unwrap_or(Expiry::Clear);
        // `GET`: the reply is the value the key held, read before anything is stored (so
        // its blocks are not held while the new value needs room), whether or not `NX` or
        // `XX` let the SET store.
        let old = get.then(|| {
            let mut old = Vec::new();
            let extents = self.lock().get(key);
            self.reply_value(key, extents, &mut old);
            old
        });
        let stored = match expiry {
            Expiry::At(at) if at <= now_ms() => {
                // Stored and at once expired, as Redis has it: the key is gone.
                let mut ix = self.lock();
                let allowed = only.allows(ix.contains(key));
                if allowed {
                    ix.remove(key);
                }
                Ok(allowed)
            }
            _ => self.store(key, value, only, expiry),
        };
        match (stored, old) {
            (Err(e), _) => reply::error(out, &e),
            (Ok(_), Some(old)) => out.extend_from_slice(&old),
            (Ok(true), None) => reply::ok(out),
            (Ok(false), None) => reply::null(out),
        }
    }

    /// `EXPIRE key seconds`, `PEXPIRE key ms`, `EXPIREAT key unix-s`, `PEXPIREAT key
    /// unix-ms`, each with `NX | XX | GT | LT` as Redis 7 has them (a key without a
    /// deadline counts as never expiring for `GT` and `LT`); a deadline already passed
    /// removes the key. 1 when the deadline was set (or the key removed), 0 otherwise.
    fn expire(&self, name: &str, args: &[&[u8]], out: &mut Vec<u8>) {
        let [key, amount, opts @ ..] = args else {
            reply::error(
                out,
                &format!("ERR wrong number of arguments for '{name}' command"),
            );
            return;
        };
        let Some(amount) = integer(amount) else {
            reply::error(out, "ERR value is not an integer or out of range");
            return;
        };
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for o in opts {
            match o.to_ascii_lowercase().as_slice() {
                b"nx" => nx = true,
                b"xx" => xx = true,
                b"gt" => gt = true,
                b"lt" => lt = true,
                _ => {
                    let o = String::from_utf8_lossy(o);
                    reply::error(out, &format!("ERR Unsupported option {o}"));
                    return;
                }
            }
        }
        if nx && (xx || gt || lt) {
            reply::error(
                out,
                "ERR NX and XX, GT or LT options at the same time are not compatible",
            );
            return;
        }
        if gt && lt {
            reply::error(
                out,
                "ERR GT and LT options at the same time are not compatible",
            );
            return;
        }
        let seconds = matches!(name, "expire" | "expireat");
        let relative = matches!(name, "expire" | "pexpire");
        let now = now_ms();
        let Some(at) = deadline_of(amount, seconds, relative, now) else {
            reply::error(out, &format!("ERR invalid expire time in '{name}' command"));
            return;
        };
        let mut ix = self.lock();
        let Some(current) = ix.deadline(key) else {
            drop(ix);
            reply::integer(out, 0);
            return;
        };
        let current = current.map(|d| i64::try_from(d).unwrap_or(i64::MAX));
        let allowed = match current {
            _ if nx => current.is_none(),
            _ if xx => current.is_some(),
            None => !gt,
            Some(c) => !(gt && at <= c || lt && at >= c),
        };
        if allowed {
            if at <= now {
                ix.remove(key);
            } else {
                ix.set_deadline(key, u64::try_from(at).ok());
            }
        }
        drop(ix);
        reply::integer(out, i64::from(allowed));
    }

    /// `TTL` and `PTTL` (what is left, seconds rounded), `EXPIRETIME` and `PEXPIRETIME`
    /// (the deadline, unix time): -2 for a key not held, -1 for one without a deadline.
    fn ttl(&self, name: &str, key: &[u8], out: &mut Vec<u8>) {
        let deadline = self.lock().deadline(key);
        let n = match deadline {
            None => -2,
            Some(None) => -1,
            Some(Some(d)) => {
                let d = i64::try_from(d).unwrap_or(i64::MAX);
                let ms = match name {
                    "ttl" | "pttl" => d.saturating_sub(now_ms()).max(0),
                    _ => d,
                };
                match name {
                    "ttl" | "expiretime" => ms.saturating_add(500) / 1000,
                    _ => ms,
                }
            }
        };
        reply::integer(out, n);
    }

    /// Stores `value` under `key` if `only` allows: blocks from the index, the bytes to the
    /// target, then the key published (a reader never sees a value half written). `only`
    /// is checked before the I/O and again, under the same lock as the publishing, after
    /// it: of two `SET … NX` of one key at once, one stores. `false`: not stored.
    fn store(&self, key: &[u8], value: &[u8], only: Only, expiry: Expiry) -> Result<bool, String> {
        let mut ix = self.lock();
        let before = ix.deadline(key);
        if !only.allows(before.is_some()) {
            return Ok(false);
        }
        let (mut extents, took_its_own) = ix
            .allocate_replacing(key, value.len() as u64)
            .map_err(|e| refusal(&e))?;
        drop(ix);
        self.fill(&mut extents, value);
        if extents.inline().is_none() {
            self.write_values(&[(&extents, value)])
                .map_err(|e| self.write_failed(&e))?;
        }
        let mut ix = self.lock();
        // The key's own value, given up to make room, still counts as there.
        if !only.allows(took_its_own || ix.contains(key)) {
            return Ok(false);
        }
        let deadline = match expiry {
            Expiry::Clear => None,
            // The deadline of the value replaced (given up for room, it was the one
            // before the write).
            Expiry::Keep => match ix.deadline(key) {
                Some(d) => d,
                None if took_its_own => before.flatten(),
                None => None,
            },
            Expiry::At(at) => u64::try_from(at).ok(),
        };
        ix.insert(key, extents);
        ix.set_deadline(key, deadline);
        Ok(true)
    }

    /// Stores each of `items` (key, value) as `SET key value` would, in order, their
    /// writes sent to the target together (an `MSET`, a run of pipelined `SET`s): about
    /// one round trip for them all rather than one each. Blocks are taken for the values
    /// first, up to [`KvService::batch_limit`] bytes at a time (blocks taken and not yet
    /// written cannot be evicted for other clients); should the store find no room for
    /// one while others wait to be written, those are written and made their keys' first
    /// and room is sought again, as one `SET` after another would find it.
    fn store_all(&self, items: &[(&[u8], &[u8])]) -> Vec<Result<(), String>> {
        let mut results = vec![Ok(()); items.len()];
        let mut waiting = Vec::new();
        let mut waiting_bytes = 0;
        for (i, (key, value)) in items.iter().enumerate() {
            let len = value.len() as u64;
            if waiting_bytes + len > self.batch_limit() {
                self.commit(items, &mut waiting, &mut results);
                waiting_bytes = 0;
            }
            let mut taken = self.lock().allocate(key, len);
            if matches!(taken, Err(StoreError::Busy)) && !waiting.is_empty() {
                self.commit(items, &mut waiting, &mut results);
                waiting_bytes = 0;
                taken = self.lock().allocate(key, len);
            }
            match taken {
                Ok(mut extents) => {
                    self.fill(&mut extents, value);
                    waiting.push((i, extents));
                    waiting_bytes += len;
                }
                Err(e) => results[i] = Err(refusal(&e)),
            }
        }
        self.commit(items, &mut waiting, &mut results);
        results
    }

    /// Notes the checksum of `value`, about to be `extents`' value, and keeps its bytes in
    /// memory if it is small enough (`inline_max`): such a value is not written to the
    /// target until the index is saved.
    fn fill(&self, extents: &mut Extents, value: &[u8]) {
        extents.set_checksum(crc32c(value));
        if value.len() as u64 <= self.config.inline_max {
            extents.keep_inline(value);
        }
    }

    /// The most bytes of values one client's run of writes holds blocks for at a time: a
    /// sixteenth of the store, at most 16 MiB (past a few MiB the transfer, not the round
    /// trips, takes the time).
    fn batch_limit(&self) -> u64 {
        (self.config.capacity / 16).min(16 << 20)
    }

    /// Writes the values of the `items` that `waiting` took blocks for (by index), in one
    /// run (those kept in memory are not written now), and makes each its key's, without
    /// a deadline; if the write fails, each of them answers the error (their blocks go
    /// back to the free list).
    fn commit(
        &self,
        items: &[(&[u8], &[u8])],
        waiting: &mut Vec<(usize, Extents)>,
        results: &mut [Result<(), String>],
    ) {
        if waiting.is_empty() {
            return;
        }
        let values: Vec<_> = waiting
            .iter()
            .filter(|(_, e)| e.inline().is_none())
            .map(|(i, e)| (e, items[*i].1))
            .collect();
        let written = if values.is_empty() {
            Ok(())
        } else {
            self.write_values(&values)
        };
        match written {
            Ok(()) => {
                let mut ix = self.lock();
                for (i, extents) in waiting.drain(..) {
                    ix.insert(items[i].0, extents);
                }
            }
            Err(e) => {
                let e = self.write_failed(&e);
                for (i, _) in waiting.drain(..) {
                    results[i] = Err(e.clone());
                }
            }
        }
    }

    /// Writes values over their blocks, a piece per run, all sent together on one target
    /// connection; lengths rounded up to the target's alignment (a value's padding stays
    /// inside its last block).
    fn write_values(&self, values: &[(&Extents, &[u8])]) -> io::Result<()> {
        let (bs, align) = (self.config.block_size, self.align as usize);
        // A value ending inside a unit of the alignment has that unit written from a copy,
        // padded: only a value's last run can end inside a block. The copies one after
        // another.
        let partial = values.iter().filter(|(_, v)| v.len() % align != 0);
        let mut tails = vec![0u8; partial.clone().count() * align];
        for ((_, v), tail) in partial.zip(tails.chunks_mut(align)) {
            let bytes = &v[v.len() - v.len() % align..];
            tail[..bytes.len()].copy_from_slice(bytes);
        }
        let mut tails = tails.chunks(align);
        let mut pieces = Vec::new();
        for (extents, value) in values {
            let mut at = 0usize;
            for (first, n) in extents.runs() {
                let len = ((n * bs) as usize).min(value.len() - at);
                let whole = len - len % align;
                pieces.push((first * bs, &value[at..at + whole]));
                if whole < len {
                    let tail = tails.next().expect("a tail for each partial value");
                    pieces.push((first * bs + whole as u64, tail));
                }
                at += len;
            }
        }
        pieces.retain(|(_, data)| !data.is_empty());
        self.with_target(WRITE, |t| t.write_many(&pieces))?;
        let bytes: usize = values.iter().map(|(_, v)| v.len()).sum();
        self.counters.written_bytes.fetch_add(bytes as u64, Relaxed);
        Ok(())
    }

    /// The reply to a failed write, counted and logged.
    fn write_failed(&self, e: &io::Error) -> String {
        self.counters.storage_errors.fetch_add(1, Relaxed);
        tracing::warn!(service = %self.name, error = %e, "kvcache write failed");
        format!("ERR storage write failed: {e}")
    }

    /// Runs a value's storage I/O `f` of `operation` ([`STORAGE_OPERATIONS`]) on a target
    /// connection, timing the wait for the connection and the I/O.
    fn with_target<T>(
        &self,
        operation: usize,
        mut f: impl FnMut(&mut dyn BlockTarget) -> io::Result<T>,
    ) -> io::Result<T> {
        let asked = Instant::now();
        let mut waited = false;
        self.pool.with(|t| {
            let began = Instant::now();
            // Once: a second run is the I/O again on a fresh connection.
            if !std::mem::replace(&mut waited, true) {
                self.counters.connection_waits.observe(began - asked);
            }
            let done = f(t);
            self.counters.storage[operation].observe(began.elapsed());
            done
        })
    }

    /// Where the first value of a reply starts: on a cache line, or on a sector of a target
    /// read directly, so that its bytes go from the device into the reply without a copy.
    fn value_alignment(&self) -> usize {
        CACHE_LINE.max(self.align as usize)
    }

    /// Appends `key`'s value as a bulk string (or the null bulk string) to `out`, read from
    /// the target straight into `out`.
    fn get(&self, key: &[u8], out: &mut Replies) {
        let extents = self.lock().get(key);
        if let Some(len) = read_len(extents.as_deref()) {
            out.align_value(len, self.value_alignment());
        }
        self.reply_value(key, extents, out);
    }

    /// The values of `keys`, their replies one after another in `out` (a pipeline's
    /// `GET`s, an `MGET`'s array), sent to `stream` whenever a [`REPLY_SHARE`] has been
    /// read, the last share left in `out`.
    fn values_in_shares(
        &self,
        keys: &[&[u8]],
        out: &mut Replies,
        stream: &mut impl Write,
    ) -> io::Result<()> {
        let mut served = self.values_share(keys, out);
        while served < keys.len() {
            send(stream, out)?;
            served += self.values_share(&keys[served..], out);
        }
        Ok(())
    }

    /// The values of the first of `keys`, up to the one that makes their length reach
    /// [`REPLY_SHARE`], their replies one after another, read from the target in one run
    /// (see [`KvService::reply_values`]); how many keys that was (at least one).
    fn values_share(&self, keys: &[&[u8]], out: &mut Replies) -> usize {
        let values: Vec<_> = {
            let mut ix = self.lock();
            let mut bytes = 0;
            keys.iter()
                .map_while(|key| {
                    (bytes < REPLY_SHARE).then(|| {
                        let value = ix.get(key);
                        bytes += value.as_ref().map_or(0, |e| e.len() as usize);
                        value
                    })
                })
                .collect()
        };
        // Room for every reply of the share at once: growing it for a later value would
        // move the first off the place `align_value` chose for it.
        let room: usize = values
            .iter()
            .map(|v| {
                v.as_ref().map_or(5, |e| {
                    reply::bulk_header_len(e.len() as usize) + e.len() as usize + 2
                })
            })
            .sum();
        out.reserve(room + self.value_alignment());
        if let Some(len) = read_len(values.first().and_then(Option::as_deref)) {
            out.align_value(len, self.value_alignment());
        }
        self.reply_values(&keys[..values.len()], &values, out);
        values.len()
    }

    /// `SET key value` of each of `items`, their replies one after another, the values
    /// written in one run (see [`KvService::store_all`]); each counted and timed as a
    /// `SET`.
    fn sets(&self, items: &[(&[u8], &[u8])], out: &mut Vec<u8>) {
        let since = Instant::now();
        for stored in self.store_all(items) {
            match stored {
                Ok(()) => reply::ok(out),
                Err(e) => reply::error(out, &e),
            }
        }
        self.count_run("set", items.len(), since);
    }

    /// Counts `n` requests of the timed `command` served together since `since`, each
    /// timed with the run's duration.
    fn count_run(&self, command: &str, n: usize, since: Instant) {
        let timed = TIMED
            .iter()
            .position(|c| *c == command)
            .expect("a timed command");
        self.count_n(command, n as u64);
        self.counters.durations[timed].observe_n(since.elapsed(), n as u64);
    }

    /// `GETDEL key`: the value, and the key gone, at once (the blocks stay readable to
    /// this request through its own reference).
    fn getdel(&self, key: &[u8], out: &mut Vec<u8>) {
        let extents = {
            let mut ix = self.lock();
            let extents = ix.get(key);
            ix.remove(key);
            extents
        };
        self.reply_value(key, extents, out);
    }

    /// `GETEX key [EX s | PX ms | EXAT unix-s | PXAT unix-ms | PERSIST]`: the value, its
    /// deadline set or taken away at once; a deadline already past removes the key.
    fn getex(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        let Some((key, opts)) = args.split_first() else {
            reply::error(out, "ERR wrong number of arguments for 'getex' command");
            return;
        };
        let now = now_ms();
        let change = match opts {
            [] => None,
            [o] if o.eq_ignore_ascii_case(b"persist") => Some(None),
            [o, amount] => {
                let Some(unit) = expiry_unit(&o.to_ascii_lowercase()) else {
                    reply::error(out, "ERR syntax error");
                    return;
                };
                match option_deadline("getex", unit, amount, now) {
                    Ok(at) => Some(Some(at)),
                    Err(e) => {
                        reply::error(out, &e);
                        return;
                    }
                }
            }
            _ => {
                reply::error(out, "ERR syntax error");
                return;
            }
        };
        let extents = {
            let mut ix = self.lock();
            let extents = ix.get(key);
            match change {
                Some(Some(at)) if at <= now => {
                    ix.remove(key);
                }
                Some(at) => {
                    ix.set_deadline(key, at.and_then(|at| u64::try_from(at).ok()));
                }
                None => {}
            }
            extents
        };
        self.reply_value(key, extents, out);
    }

    /// `key`'s value as a bulk string, read from the target straight into `out`; the null
    /// bulk string for none.
    fn reply_value(&self, key: &[u8], extents: Option<Arc<Extents>>, out: &mut Vec<u8>) {
        self.reply_values(&[key], &[extents], out);
    }

    /// The values of `keys` as bulk strings one after another (the null bulk string for
    /// none): those kept in memory copied, the rest read from the target straight into
    /// `out` in one run of requests on one connection, so an `MGET` waits about one round
    /// trip rather than one a value. A value whose length is not whole units of the
    /// target's alignment has its last unit read aside and copied in. If the read fails,
    /// each value read answers the error. A value that does not match its checksum is
    /// answered as a miss (see [`KvService::drop_corrupt`]).
    fn reply_values(&self, keys: &[&[u8]], values: &[Option<Arc<Extents>>], out: &mut Vec<u8>) {
        let before = out.len();
        // Each value to read from the target: its index in `values`, where it goes in
        // `out`, its blocks.
        let mut held = Vec::new();
        let (mut missed, mut in_memory) = (0, 0);
        for (i, v) in values.iter().enumerate() {
            match v {
                None => {
                    reply::null(out);
                    missed += 1;
                }
                Some(extents) => {
                    let len = extents.len() as usize;
                    reply::bulk_header(out, len);
                    match extents.inline() {
                        Some(bytes) => {
                            out.extend_from_slice(bytes);
                            in_memory += 1;
                        }
                        None => {
                            held.push((i, out.len(), extents));
                            // Room for the value and its CRLF at once: a large reply's
                            // buffer is its size, not doubled by the last two bytes.
                            out.reserve(len + 2);
                            out.resize(out.len() + len, 0);
                        }
                    }
                    out.extend_from_slice(b"\r\n");
                }
            }
        }
        self.counters.hits.fetch_add(in_memory, Relaxed);
        if held.is_empty() {
            self.counters.misses.fetch_add(missed, Relaxed);
            return;
        }
        let (bs, align) = (self.config.block_size, self.align as usize);
        let partial = held
            .iter()
            .filter(|(_, _, e)| e.len() as usize % align != 0);
        // The last unit of each value that ends inside one, read aside, one after another.
        let mut tails = vec![0u8; partial.count() * align];
        // Where each tail's bytes go in `out`: (position, tail, bytes).
        let mut copies = Vec::new();
        let read = {
            let mut pieces = Vec::new();
            let mut tail_bufs = tails.chunks_mut(align).enumerate();
            let (mut rest, mut at) = (&mut out[..], 0usize);
            for &(_, start, extents) in &held {
                let (_, from) = std::mem::take(&mut rest).split_at_mut(start - at);
                let (mut value, after) = from.split_at_mut(extents.len() as usize);
                (rest, at) = (after, start + value.len());
                let mut pos = start;
                for (first, n) in extents.runs() {
                    let run = ((n * bs) as usize).min(value.len());
                    let (piece, after) = std::mem::take(&mut value).split_at_mut(run);
                    value = after;
                    let whole = run - run % align;
                    if whole > 0 {
                        pieces.push((first * bs, &mut piece[..whole]));
                    }
                    if whole < run {
                        let (i, tail) = tail_bufs.next().expect("a tail for each partial value");
                        pieces.push((first * bs + whole as u64, tail));
                        copies.push((pos + whole, i, run - whole));
                    }
                    pos += run;
                }
            }
            self.with_target(READ, |t| t.read_many(&mut pieces))
        };
        match read {
            Ok(()) => {
                for (at, i, n) in copies {
                    out[at..at + n].copy_from_slice(&tails[i * align..i * align + n]);
                }
                let bytes: u64 = held.iter().map(|(_, _, e)| e.len()).sum();
                self.counters.read_bytes.fetch_add(bytes, Relaxed);
                // The values that do not match their checksums, by index, ascending.
                let corrupt: Vec<usize> = held
                    .iter()
                    .filter(|(_, at, e)| {
                        e.checksum()
                            .is_some_and(|c| crc32c(&out[*at..*at + e.len() as usize]) != c)
                    })
                    .map(|&(i, _, _)| i)
                    .collect();
                let n = corrupt.len() as u64;
                self.counters.hits.fetch_add(held.len() as u64 - n, Relaxed);
                self.counters.misses.fetch_add(missed + n, Relaxed);
                if !corrupt.is_empty() {
                    self.drop_corrupt(keys, values, &corrupt, before, out);
                }
            }
            Err(e) => {
                self.counters.hits.fetch_add(held.len() as u64, Relaxed);
                self.counters.misses.fetch_add(missed, Relaxed);
                out.truncate(before);
                self.counters.storage_errors.fetch_add(1, Relaxed);
                tracing::warn!(service = %self.name, error = %e, "kvcache read failed");
                for v in values {
                    match v.as_deref().map(|e| e.inline()) {
                        None => reply::null(out),
                        Some(Some(bytes)) => reply::bulk(out, bytes),
                        Some(None) => reply::error(out, &format!("ERR storage read failed: {e}")),
                    }
                }
            }
        }
    }

    /// Answers the values [`KvService::reply_values`] read into `out` (their replies one
    /// after another from `before` on) that did not match their checksums (their indices
    /// in `corrupt`, ascending) as misses, and removes their keys unless they have new
    /// values since: the target returned other bytes than were written (a failing disk,
    /// an image changed under the service), and a cache's right answer to a value it
    /// cannot vouch for is none, which a client fills again, rather than wrong bytes or an
    /// error it may not expect. Counted and logged.
    #[cold]
    fn drop_corrupt(
        &self,
        keys: &[&[u8]],
        values: &[Option<Arc<Extents>>],
        corrupt: &[usize],
        before: usize,
        out: &mut Vec<u8>,
    ) {
        let read = out.split_off(before);
        let mut replies = &read[..];
        for (i, value) in values.iter().enumerate() {
            // A null bulk string, or a bulk string's header, its bytes and CRLF.
            let len = value.as_ref().map_or(b"$-1\r\n".len(), |e| {
                let n = e.len() as usize;
                reply::bulk_header_len(n) + n + 2
            });
            let (reply, rest) = replies.split_at(len);
            replies = rest;
            let (Some(extents), Ok(_)) = (value, corrupt.binary_search(&i)) else {
                out.extend_from_slice(reply);
                continue;
            };
            let key = keys[i];
            reply::null(out);
            self.counters.corrupt_values.fetch_add(1, Relaxed);
            self.lock().remove_value(key, extents);
            tracing::warn!(
                service = %self.name,
                key = %String::from_utf8_lossy(key),
                "kvcache value read back does not match its checksum: answered as a miss, key removed"
            );
        }
    }

    /// `SCAN cursor [MATCH pattern] [COUNT n] [TYPE type]`. Keys are visited in the order of
    /// a hash fixed for the service's life, and the cursor is the hash to go on from, so
    /// a key held from the first call to the last is returned once, whatever is added or
    /// removed meanwhile (Redis's guarantee). Each call looks at every key: a tool's walk,
    /// not a request path.
    fn scan(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        let Some((cursor, opts)) = args.split_first() else {
            reply::error(out, "ERR wrong number of arguments for 'scan' command");
            return;
        };
        let Some(cursor) = std::str::from_utf8(cursor)
            .ok()
            .and_then(|c| c.parse::<u64>().ok())
        else {
            reply::error(out, "ERR invalid cursor");
            return;
        };
        let (mut pattern, mut count, mut strings) = (&b"*"[..], 10usize, true);
        for opt in opts.chunks(2) {
            match (opt[0].to_ascii_lowercase().as_slice(), opt.get(1)) {
                (b"match", Some(p)) => pattern = p,
                (b"count", Some(n)) => {
                    match std::str::from_utf8(n).ok().and_then(|n| n.parse().ok()) {
                        Some(n) if n > 0 => count = n,
                        _ => {
                            reply::error(out, "ERR value is not an integer or out of range");
                            return;
                        }
                    }
                }
                // Every value is a string.
                (b"type", Some(t)) => strings = t.eq_ignore_ascii_case(b"string"),
                _ => {
                    reply::error(out, "ERR syntax error");
                    return;
                }
            }
        }
        let ix = self.lock();
        let mut next: Vec<(u64, &[u8])> = ix
            .keys()
            .map(|k| (self.scan_order.hash_one(k), k))
            .filter(|(h, _)| *h >= cursor)
            .collect();
        next.sort_unstable();
        // This call's keys: the first `count`, and any sharing the last one's hash (the
        // cursor cannot split them).
        let mut end = count.min(next.len());
        while end > 0 && end < next.len() && next[end].0 == next[end - 1].0 {
            end += 1;
        }
        let cursor = match next.get(end) {
            Some(_) => next[end - 1].0 + 1,
            None => 0,
        };
        let keys: Vec<&[u8]> = next[..end]
            .iter()
            .map(|(_, k)| *k)
            .filter(|k| strings && glob::matches(pattern, k))
            .collect();
        reply::array(out, 2);
        reply::bulk(out, cursor.to_string().as_bytes());
        reply::array(out, keys.len());
        for k in keys {
            reply::bulk(out, k);
        }
    }

    /// `CONFIG GET pattern`: the few settings clients ask for (redis-benchmark asks for
    /// `save` and `appendonly`); `CONFIG SET` is refused.
    fn config_command(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        let [sub, pattern] = args else {
            reply::error(
                out,
                "ERR unknown subcommand or wrong number of arguments for 'config'",
            );
            return;
        };
        if !sub.eq_ignore_ascii_case(b"get") {
            reply::error(
                out,
                "ERR the kvcache service's settings live in its pipeline file",
            );
            return;
        }
        let settings = [
            ("save", String::new()),
            ("appendonly", "no".to_owned()),
            ("maxmemory", self.config.capacity.to_string()),
            ("maxmemory-policy", "allkeys-lru".to_owned()),
            ("databases", "1".to_owned()),
        ];
        let pattern = String::from_utf8_lossy(pattern).to_ascii_lowercase();
        let hits: Vec<_> = settings
            .iter()
            .filter(|(k, _)| pattern == "*" || pattern == *k)
            .collect();
        reply::array(out, hits.len() * 2);
        for (k, v) in hits {
            reply::bulk(out, k.as_bytes());
            reply::bulk(out, v.as_bytes());
        }
    }

    /// A request on a connection that has not authenticated: only `AUTH`, `HELLO … AUTH`
    /// and `QUIT` are served (as Redis does with `requirepass`); `true` when the client
    /// asked to leave.
    fn unauthenticated(&self, words: &[&[u8]], out: &mut Vec<u8>, authed: &mut bool) -> bool {
        let Some((name, args)) = words.split_first() else {
            return false;
        };
        match name.to_ascii_lowercase().as_slice() {
            b"auth" => match self.auth(args) {
                Ok(()) => {
                    *authed = true;
                    reply::ok(out);
                }
                Err(e) => reply::error(out, e),
            },
            b"hello" if args.len() > 1 => *authed = self.hello_command(args, out),
            b"hello" => reply::error(
                out,
                "NOAUTH HELLO must be called with the client already authenticated, otherwise \
                 the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the \
                 client and select the RESP protocol version at the same time",
            ),
            b"quit" => {
                reply::ok(out);
                return true;
            }
            _ => reply::error(out, "NOAUTH Authentication required."),
        }
        false
    }

    /// `AUTH [default] password`.
    fn auth(&self, args: &[&[u8]]) -> Result<(), &'static str> {
        let Some(password) = &self.password else {
            return Err(
                "ERR AUTH <password> called without any password configured for the \
                        default user. Are you sure your configuration is correct?",
            );
        };
        let given = match args {
            [p] => p,
            [user, p] if *user == b"default" => p,
            [_, _] => {
                self.counters.auth_failures.fetch_add(1, Relaxed);
                return Err("WRONGPASS invalid username-password pair or user is disabled.");
            }
            _ => return Err("ERR wrong number of arguments for 'auth' command"),
        };
        if same_secret(given, password) {
            Ok(())
        } else {
            self.counters.auth_failures.fetch_add(1, Relaxed);
            tracing::info!(service = %self.name, "kvcache: a client gave a wrong password");
            Err("WRONGPASS invalid username-password pair or user is disabled.")
        }
    }

    /// `HELLO [2 [AUTH user password] [SETNAME name]]`; whether the client is now
    /// authenticated (by this request's `AUTH`).
    fn hello_command(&self, args: &[&[u8]], out: &mut Vec<u8>) -> bool {
        let Some((version, opts)) = args.split_first() else {
            self.hello(out);
            return false;
        };
        if *version != b"2" {
            reply::error(out, "NOPROTO this protocol version is not supported");
            return false;
        }
        let mut authed = false;
        let mut rest = opts;
        while let Some((opt, tail)) = rest.split_first() {
            match (opt.to_ascii_lowercase().as_slice(), tail) {
                (b"auth", [user, pass, more @ ..]) => {
                    if let Err(e) = self.auth(&[user, pass]) {
                        reply::error(out, e);
                        return false;
                    }
                    authed = true;
                    rest = more;
                }
                (b"setname", [_, more @ ..]) => rest = more,
                _ => {
                    reply::error(out, "ERR syntax error in HELLO option");
                    return false;
                }
            }
        }
        self.hello(out);
        authed
    }

    /// `HELLO` in RESP2: the server's facts as a flat array.
    fn hello(&self, out: &mut Vec<u8>) {
        let facts = [
            ("server", "dpuflow"),
            ("version", env!("CARGO_PKG_VERSION")),
            ("proto", "2"),
            ("mode", "standalone"),
            ("role", "master"),
        ];
        reply::array(out, facts.len() * 2 + 2);
        for (k, v) in facts {
            reply::bulk(out, k.as_bytes());
            if k == "proto" {
                reply::integer(out, 2);
            } else {
                reply::bulk(out, v.as_bytes());
            }
        }
        reply::bulk(out, b"modules");
        reply::array(out, 0);
    }

    /// `INFO`: Redis's sections that clients read, and the service's own.
    fn info(&self) -> String {
        let g = self.gauges();
        let c = &self.counters;
        let changes = (self.lock().changes()).saturating_sub(c.changes_at_last_save.load(Relaxed));
        let saving = matches!(self.checkpoints.try_lock(), Err(TryLockError::WouldBlock));
        let last_save = if c.last_save_failed.load(Relaxed) {
            "err"
        } else {
            "ok"
        };
        format!(
            "# Server\r\nredis_version:7.0.0\r\ndpuflow_version:{}\r\nredis_mode:standalone\r\n\
             tcp_port:{}\r\n\r\n# Clients\r\nconnected_clients:{}\r\n\r\n# Memory\r\n\
             maxmemory:{}\r\nmaxmemory_policy:allkeys-lru\r\n\r\n# Stats\r\n\
             keyspace_hits:{}\r\nkeyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:{}\r\n\r\n\
             # Persistence\r\nloading:0\r\nrdb_changes_since_last_save:{}\r\n\
             rdb_bgsave_in_progress:{}\r\nrdb_last_save_time:{}\r\nrdb_last_bgsave_status:{}\r\n\r\n\
             # Kvcache\r\n\
             target:{}\r\nblock_size:{}\r\ncapacity_bytes:{}\r\nused_bytes:{}\r\ninline_bytes:{}\r\n\
             storage_read_bytes:{}\r\nstorage_written_bytes:{}\r\nstorage_errors:{}\r\n\
             corrupt_values:{}\r\nrestored_keys:{}\r\ncheckpoints:{}\r\ncheckpoint_failures:{}\r\n\
             checkpoint_overruns:{}\r\nlast_checkpoint_time:{}\r\n\r\n# Keyspace\r\ndb0:keys={},expires={},avg_ttl=0\r\n",
            crate::VERSION,
            self.listen.port(),
            c.clients.load(Relaxed),
            self.config.capacity,
            c.hits.load(Relaxed),
            c.misses.load(Relaxed),
            g.evictions,
            g.expired,
            changes,
            u8::from(saving),
            c.last_save_ms.load(Relaxed) / 1000,
            last_save,
            storage::describe_all(&self.config.targets),
            self.config.block_size,
            g.capacity_bytes,
            g.used_bytes,
            g.inline_bytes,
            c.read_bytes.load(Relaxed),
            c.written_bytes.load(Relaxed),
            c.storage_errors.load(Relaxed),
            c.corrupt_values.load(Relaxed),
            self.restored_keys,
            c.checkpoints.load(Relaxed),
            c.checkpoint_failures.load(Relaxed),
            g.hold_back_overruns,
            c.last_save_ms.load(Relaxed) / 1000,
            g.keys,
            g.expiring,
        )
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

/// The length of `value` when its bytes are to be read from the target (not kept in
/// memory).
fn read_len(value: Option<&Extents>) -> Option<usize> {
    value
        .filter(|e| e.inline().is_none())
        .map(|e| e.len() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::StorageTarget;
    use crate::kvcache::resp::ProtocolError;

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
        assert_eq!(svc.values_share(&keys, &mut out), 4);
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
    fn on_with(
        path: &std::path::Path,
        capacity: u64,
        block: u64,
        inline_max: u64,
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
            password_file: None,
            tls: None,
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
            password_file: Some(secret.clone()),
            tls: None,
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
        talk(&mut c, "HELLO 2 AUTH default s3cret\r\n", "*12\r\n");
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
            password_file: None,
            tls: None,
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
            password_file: None,
            tls: None,
        }
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

    /// The reply to `words`, as it is sent to a client that sends them.
    fn run(svc: &KvService, words: &[&[u8]]) -> Vec<u8> {
        let mut request = Vec::new();
        reply::array(&mut request, words.len());
        for w in words {
            reply::bulk(&mut request, w);
        }
        let mut client = Scripted {
            pieces: [request].into(),
            written: Vec::new(),
        };
        svc.talk(&mut client).expect("talk");
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
                        svc.execute(&[b"SET", key.as_bytes(), &[t; 3000], b"NX"], &mut out);
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

    #[test]
    fn integers_are_read_as_redis_reads_them() {
        assert_eq!(integer(b"0"), Some(0));
        assert_eq!(integer(b"-12"), Some(-12));
        assert_eq!(integer(b"9223372036854775807"), Some(i64::MAX));
        for bad in [
            &b""[..],
            b"-",
            b"-0",
            b"01",
            b"+1",
            b" 1",
            b"1x",
            b"9223372036854775808",
        ] {
            assert_eq!(integer(bad), None, "{bad:?}");
        }
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
            b"-ERR unknown command 'foo', with args beginning with: 'bar'\r\n"
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
        assert_eq!(
            back,
            format!("-ERR {}\r\n", ProtocolError::ExpectedBulk).into_bytes()
        );
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
                        None => reply::null(&mut expect),
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
            svc.talk(&mut client).unwrap();
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
        reply::null(&mut expect);
        reply::null(&mut expect);
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
        reply::null(&mut expect);
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
                                svc.execute(&[b"SET", key.as_bytes(), &fill(k, i % 16)], &mut out);
                                assert_eq!(out.pending(), b"+OK\r\n");
                            }
                            2 => {
                                svc.execute(&[b"DEL", key.as_bytes()], &mut out);
                            }
                            _ => {
                                svc.execute(&[b"GET", key.as_bytes()], &mut out);
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
}
