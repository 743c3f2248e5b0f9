//! `dpuflow run`: the long-running service. An I/O thread reads the inputs (capture files
//! merged in timestamp order, or live ports in turn, `crate::io`) and deals packets to
//! worker threads by a symmetric flow hash (both
//! directions of a connection reach the same worker and its connection table); each
//! worker owns an engine and sends its processed batches back to the I/O thread, which
//! writes what they forward (and the copies `mirror` actions made), keeps their buffers
//! for the packets it reads next, and hands the copies' buffers back to their worker. The
//! main thread serves metrics. Batches travel through bounded crossbeam channels, so a
//! slow stage holds the others back instead of buffering without bound, and buffers are
//! reused, never allocated per packet.
//!
//! Reading and writing share one thread so that one worker and its I/O take two cores,
//! not three threads on two: a separate writer, woken by every batch, kept preempting the
//! worker wherever they shared a core, and the service's rate halved in such runs.
//!
//! With several workers on live ports and no capture output, there is no I/O thread:
//! each worker reads and sends its own share of every port and runs its engine in the
//! same thread, as one worker does with its I/O. On AF_PACKET its share is a socket of
//! its own in the port's fanout group, the kernel dealing the frames by its flow hash, or,
//! where the pipeline tracks connections, by the dealer's own choice (tunnels parsed, the
//! two directions met, ICMP errors and fragments with their connection) as an eBPF
//! program of it (`steering.rs`). On AF_XDP it is receive queues of its own (the NIC's
//! hash picks the queue, which keeps a flow together but not a connection's two
//! directions: a pipeline that tracks connections has the I/O thread deal).
//!
//! With live ports, time is the time of day and passes without packets: the I/O thread
//! hands part-filled batches over whenever no frame waits, and idle workers sweep their
//! tables and publish their counts by the clock.
//!
//! SIGTERM or SIGINT stops the reading; the batches already read are processed and
//! written, outputs are flushed, the last flows exported, and the process exits 0; a
//! second one ends it at once (status 1). SIGHUP reloads the pipeline file (`reload.rs`).

pub mod cpus;
mod liveness;
mod notify;
mod reload;
pub mod steering;

use cpus::{CpuListError, Placement};
use liveness::{Beats, Liveness};
use notify::Notifier;
pub use reload::{restart_needed, PipelineFile, TelemetryFlags};
use reload::{Loaded, ReloadError};

use crate::engine::parse;
use crate::engine::{
    Compiled, DropReason, Engine, NoObserver, PacketBuf, Verdict, DEFAULT_MAX_FRAME,
};
use crate::firewall::conntrack::Conntrack;
use crate::firewall::fragments::Fragments;
use crate::io::af_packet::Fanout;
use crate::io::af_xdp::XdpShares;
use crate::io::live::{LiveError, LivePort, PortShares, Received, Sent};
use crate::io::pcap::{CaptureError, CaptureWriter};
use crate::ir::{Driver, PortId, Program, ServiceKind};
use crate::kvcache::server::{KvService, StartError};
use crate::replay::{Bindings, Merged, Merger};
use crate::sys::Readable;
use crate::telemetry::collector::{Collector, Destination, Pacer};
use crate::telemetry::flows::{FlowCache, FlowRecord};
use crate::telemetry::http::{self, Handler};
use crate::telemetry::ipfix::Exporter;
use crate::telemetry::metrics::{self, Info, ServiceState};
use crate::telemetry::{ExportStats, Latency, Snapshot, WarnThrottle};
use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// The pipeline's file, read again on SIGHUP.
    pub pipeline: PipelineFile,
    pub bindings: Bindings,
    /// Where to serve `/metrics`; none, no endpoint.
    pub metrics: Option<SocketAddr>,
    /// IPFIX collector; none, no export.
    pub ipfix: Option<Destination>,
    /// Worker threads; none, the default: one per core, or with `cpus` one per CPU of
    /// the list (after the I/O thread's first, where there is one).
    pub workers: Option<usize>,
    /// The CPUs of the dataplane's threads (see [`cpus`]); none, threads go where the
    /// kernel puts them.
    pub cpus: Option<Vec<usize>>,
    /// Packets per second to read at most (all inputs together).
    pub rate: Option<u64>,
    /// Read the inputs again and again (timestamps keep increasing).
    pub looping: bool,
    pub batch: usize,
    /// A live port whose interface does not exist at the start waits for it (as for one
    /// removed later) instead of failing the start.
    pub wait_for_interfaces: bool,
}

/// Why the service could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// a capture file could not be opened, read or written
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// a live port could not be opened
    #[error(transparent)]
    Live(#[from] LiveError),
    /// live ports with a flag that only captures take
    #[error("{0}")]
    Inputs(String),
    /// the metrics address could not be bound
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// a signal handler could not be installed
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    /// no port reads a capture file, so there is nothing to process
    #[error(
        "no input: bind a port to a capture file with --in PORT=FILE (or its pipeline `file`)\
         {live}"
    )]
    NoInput {
        /// The ports `dpuflow run` leaves closed (doca), when the pipeline has any.
        live: String,
    },
    /// a thread of the service failed
    #[error("{0}")]
    Thread(String),
    /// the CPUs given cannot take the service's threads
    #[error(transparent)]
    Cpus(#[from] CpuListError),
    /// the service's threads could not be bound to their CPUs
    #[error("cannot bind threads to CPUs: {0}")]
    Affinity(std::io::Error),
    /// the steering program could not be kept for the ports' fanout groups
    #[error("cannot keep the fanout groups' steering program: {0}")]
    Steering(std::io::Error),
    /// a local service (the KV cache) could not start
    #[error(transparent)]
    Service(#[from] StartError),
    /// the workers' tables would not fit in memory
    #[error(
        "the workers' tables need {need_mib} MiB ({workers} workers × {tables}) but \
         {available_mib} MiB are available: lower {knobs} or --workers"
    )]
    Memory {
        need_mib: u64,
        available_mib: u64,
        workers: usize,
        /// What each worker holds, as said: "a connection table of capacity N", …
        tables: String,
        /// The settings that size them.
        knobs: String,
    },
}

/// Each worker writes its whole connection table and flow cache at start: refuses now, with
/// the sizes, rather than be killed for memory halfway through; else logs what they take.
fn enough_memory(program: &Program, flows: bool, workers: usize) -> Result<(), RunError> {
    let available = crate::sys::available_memory();
    let size = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    let mut tables = Vec::new();
    let mut knobs = Vec::new();
    let mut each = 0u64;
    if let Some(ct) = &program.conntrack {
        each += Conntrack::table_bytes(size(ct.capacity), ct.tcp_window);
        tables.push(format!("a connection table of capacity {}", ct.capacity));
        knobs.push("`conntrack { capacity }`");
    }
    if flows {
        let n = program.telemetry.flow_cache;
        each = each.saturating_add(FlowCache::table_bytes(size(n)));
        tables.push(format!("a flow cache of {n} flows"));
        knobs.push("`telemetry { flow_cache }`");
    }
    let need = each.saturating_mul(workers as u64);
    let tables = tables.join(" and ");
    match available {
        Some(available) if need > available => Err(RunError::Memory {
            need_mib: need >> 20,
            available_mib: available >> 20,
            workers,
            tables,
            knobs: knobs.join(", "),
        }),
        _ if tables.is_empty() => Ok(()),
        _ => {
            tracing::info!(
                workers,
                each = %tables,
                mib = need >> 20,
                available_mib = available.map(|a| a >> 20),
                "tables the workers write at start"
            );
            Ok(())
        }
    }
}

/// Snapshots are published at most this often by each worker (less often where copying
/// the counters takes long: see [`Worker::publish_now_or_later`]).
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
/// A worker spends at most about one part in this many of its time publishing its counts.
const PUBLISH_SHARE: u32 = 200;
/// One batch in this many is timed for the latency histogram.
const LATENCY_SAMPLE: u64 = 64;
/// Allocations of this many bytes or more get a mapping of their own, returned to the
/// system when freed (see [`crate::sys::map_large_allocations`]).
const LARGE_ALLOCATION: usize = 256 << 10;
/// Descriptors the service holds besides its KV-cache clients' (listeners, target
/// connections, ports, captures, the metrics endpoint's), rounded up.
const FDS_BESIDE_CLIENTS: u64 = 64;
/// Batches in flight between two stages.
const QUEUE: usize = 8;
/// Workers hand the flow records made to the exporter every this often…
const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// … or once this many wait (a quarter of what a connection table keeps: connections that
/// end fast would fill it in a second).
const RECORDS_EARLY: usize = crate::firewall::conntrack::RECORDS_KEPT / 4;
/// A processed batch on its way back to the I/O thread: the packets, then the copies
/// `mirror` actions made, in buffers that go back to the worker that filled them.
struct Processed {
    packets: Vec<PacketBuf>,
    mirrors: Vec<PacketBuf>,
    /// That worker's place among the I/O thread's channels ([`WorkerChannels::index`]).
    worker: usize,
}

struct Shared {
    /// The pipeline the workers run (or are about to: see [`Shared::generation`]).
    loaded: Mutex<Arc<Loaded>>,
    /// `loaded`'s generation, set once it is in place: a worker that sees it change takes
    /// the new pipeline between two batches.
    generation: AtomicU64,
    reloads: Reloads,
    info: Info,
    snapshots: Vec<Mutex<Snapshot>>,
    /// The IPFIX exporter's counts, when exporting.
    export: Option<ExportCounts>,
    /// The inputs are live ports: time is the time of day, passing with or without
    /// packets.
    live: bool,
    workers_up: AtomicUsize,
    workers: usize,
    /// The service failed: a thread panicked or the I/O thread failed (see [`Watch`]).
    failed: Arc<AtomicBool>,
    /// Frames too large for the packet buffers, per port (packets, bytes): the I/O thread
    /// skips them before any worker sees them, and counts them here for the metrics.
    oversize: Vec<[AtomicU64; 2]>,
    /// Per port: frames the kernel dropped for want of room in a live port's receive ring.
    ring_full: Vec<AtomicU64>,
    /// Per port: whether it reads or writes anything (a capture bound to it, or its live
    /// interface open).
    port_open: Vec<AtomicBool>,
    /// Live ports closed and not yet open again (see [`Outputs::waiting`]).
    ports_waiting: AtomicUsize,
    /// Per port, its fanout group, when each worker reads and sends its own share of the
    /// live ports.
    groups: Option<Vec<PortShares>>,
    /// The groups are steered by a program of the dealer's choice (the pipeline tracks
    /// connections), which knows the pipeline's tunnel ports.
    steered: bool,
    /// Per port: times its live port was closed to be opened again, by [`Closing`].
    port_closes: Vec<[AtomicU64; metrics::PORT_CLOSE_REASONS.len()]>,
    /// Per port: packets forwarded to it that were not sent, as the threads that write
    /// packets last published them (see [`Outputs::unsent`]).
    unsent: Vec<AtomicU64>,
    /// The pipeline's KV-cache services.
    kv: Vec<Arc<KvService>>,
    /// The I/O thread has ended (the inputs are done): no worker runs.
    dataplane_done: AtomicBool,
    /// The dataplane threads' rounds: worker `w`'s in slot `w`, the I/O thread's in the
    /// last (see [`liveness`]).
    beats: Beats,
    /// The dataplane threads stalled, if any (see [`judge`]).
    stalled: Mutex<Option<Stalled>>,
    /// The service manager, when one asked to be told how the service stands.
    notifier: Option<Notifier>,
}

/// Reloads done and refused, for the metrics.
#[derive(Debug, Default)]
struct Reloads {
    succeeded: AtomicU64,
    failed: AtomicU64,
    /// The last reload was refused.
    last_failed: AtomicBool,
    /// The longest a worker spent taking the last reload (its pause between two batches).
    longest_swap_ns: AtomicU64,
}

impl Shared {
    /// Where the kernel steers the ports' frames by a program of the dealer's choice and
    /// `next` carries tunnels on other UDP ports than `current`: steers them by a program
    /// that knows `next`'s.
    fn steer_for(&self, current: &Loaded, next: &Loaded) -> std::io::Result<()> {
        let Some(groups) = self.groups.as_ref().filter(|_| self.steered) else {
            return Ok(());
        };
        if current.code.tunnels() == next.code.tunnels() {
            return Ok(());
        }
        let program = steering::KernelSteering::load(self.workers, next.code.tunnels())?;
        for g in groups {
            if let PortShares::Fanout(f) = g {
                f.steer(program.fd())?;
            }
        }
        tracing::info!("the fanout groups are steered by the new tunnel ports");
        Ok(())
    }

    /// The pipeline now published.
    fn loaded(&self) -> Arc<Loaded> {
        Arc::clone(&self.loaded.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether every worker has published counts of generation `g`.
    fn workers_run(&self, g: u64) -> bool {
        self.snapshots
            .iter()
            .all(|s| s.lock().map_or(true, |s| s.generation == g))
    }
}

/// Counted by the exporter thread, read at scrape time.
#[derive(Debug, Default)]
struct ExportCounts {
    messages: AtomicU64,
    failed: AtomicU64,
    /// Nanoseconds waited to keep to the rate.
    paced_ns: AtomicU64,
}

impl Handler for Shared {
    fn metrics(&self) -> String {
        let loaded = self.loaded();
        let mut total = Snapshot::default();
        for s in &self.snapshots {
            if let Ok(s) = s.lock() {
                // A worker yet to take the latest reload counts in the previous
                // pipeline's places (a reload waits until every worker runs the one
                // before it).
                if s.generation == loaded.generation {
                    total.merge(&s);
                } else {
                    let mut lagging = s.clone();
                    lagging.stats = loaded.renumbering.stats(std::mem::take(&mut lagging.stats));
                    total.merge(&lagging);
                }
            }
        }
        for (p, [packets, bytes]) in self.oversize.iter().enumerate() {
            if let Some(s) = total.stats.ports.get_mut(p) {
                s.count_oversize(
                    packets.load(Ordering::Relaxed),
                    bytes.load(Ordering::Relaxed),
                );
                s.drops[DropReason::RingFull as usize] += self.ring_full[p].load(Ordering::Relaxed);
            }
        }
        total.export = self.export.as_ref().map(|e| ExportStats {
            messages: e.messages.load(Ordering::Relaxed),
            failed: e.failed.load(Ordering::Relaxed),
            paced_ns: e.paced_ns.load(Ordering::Relaxed),
        });
        // The dataplane's threads (named when spawned): the service's own KV clients'
        // threads come and go, and the main thread only serves scrapes.
        let dataplane = |name: &str| name == "io" || name == "ipfix" || name.starts_with("worker-");
        let state = ServiceState {
            threads: crate::sys::thread_cpu_seconds()
                .into_iter()
                .filter(|(name, _)| dataplane(name))
                .collect(),
            process: crate::sys::process_stats(),
            seconds: loaded.seconds,
            at_seconds: loaded.at_seconds(),
            reloads_succeeded: self.reloads.succeeded.load(Ordering::Relaxed),
            reloads_failed: self.reloads.failed.load(Ordering::Relaxed),
            last_reload_failed: self.reloads.last_failed.load(Ordering::Relaxed),
            stalled_threads: (self.stalled.lock().unwrap_or_else(|e| e.into_inner()))
                .as_ref()
                .map_or(0, |s| s.count),
            ports_open: self
                .port_open
                .iter()
                .map(|o| o.load(Ordering::Relaxed))
                .collect(),
            unsent: self
                .unsent
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
            port_closes: self
                .port_closes
                .iter()
                .map(|by| by.each_ref().map(|n| n.load(Ordering::Relaxed)))
                .collect(),
        };
        let mut text = metrics::render(&loaded.program, &total, &self.info, &state);
        text.push_str(&metrics::render_kv(&self.kv));
        text
    }

    /// Every worker runs, nothing failed, and every live port is open.
    fn ready(&self) -> bool {
        self.workers_up.load(Ordering::Relaxed) == self.workers
            && !self.failed.load(Ordering::Relaxed)
            && self.ports_waiting.load(Ordering::Relaxed) == 0
    }

    fn unhealthy(&self) -> Option<String> {
        let stalled = self.stalled.lock().unwrap_or_else(|e| e.into_inner());
        stalled.as_ref().map(|s| s.detail.clone())
    }
}

/// Dataplane threads found stalled.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stalled {
    count: usize,
    /// Their names (`io`, `worker-1`).
    threads: String,
    /// With for how long each has made no progress, for `/healthz`.
    detail: String,
}

impl Shared {
    /// A line on how the service stands, for `systemctl status`.
    fn status(&self) -> String {
        if let Some(s) = &*self.stalled.lock().unwrap_or_else(|e| e.into_inner()) {
            return format!("dataplane stalled: {}", s.threads);
        }
        if self.dataplane_done.load(Ordering::Relaxed) {
            return "the inputs are done; serving metrics".to_owned();
        }
        let loaded = self.loaded();
        let mut s = format!(
            "running pipeline {} (generation {}) on {} worker{}",
            loaded.program.name,
            loaded.generation,
            self.workers,
            if self.workers == 1 { "" } else { "s" }
        );
        if self.ports_waiting.load(Ordering::Relaxed) > 0 {
            // The live ports not open: those awaited (at the start, or since their
            // interface went).
            let waiting: Vec<&str> = (loaded.program.ports.iter().enumerate())
                .filter(|&(i, p)| {
                    matches!(p.driver, Driver::AfPacket | Driver::AfXdp)
                        && !self.port_open[i].load(Ordering::Relaxed)
                })
                .filter_map(|(_, p)| p.iface.as_deref())
                .collect();
            s.push_str(&format!("; waiting for interface {}", waiting.join(", ")));
        }
        if self.reloads.last_failed.load(Ordering::Relaxed) {
            s.push_str("; the last reload was refused (see the log)");
        }
        s
    }
}

/// Runs until the inputs are exhausted (then, with a metrics endpoint, until signalled) or
/// until SIGTERM or SIGINT; SIGHUP reloads the pipeline file.
pub fn run(program: Program, load_seconds: f64, opts: Options) -> Result<(), RunError> {
    // Without capture inputs, a port of driver af_packet or af_xdp bound to no capture is
    // opened live. With them, the service replays captures (in their own clock, which live
    // ports do not share): such ports are left closed. A doca port needs the hardware
    // backend. A port left closed is neither read nor written, and named at start; with
    // nothing to read, the service would serve metrics of no traffic, looking healthy:
    // refused.
    let bound = |i: usize| {
        let b = &opts.bindings;
        b.inputs
            .iter()
            .chain(&b.outputs)
            .any(|(id, _)| usize::from(id.0) == i)
    };
    let replays = !opts.bindings.inputs.is_empty();
    let has_live = |driver: Driver| {
        let mut ports = program.ports.iter().enumerate();
        !replays && ports.any(|(i, p)| p.driver == driver && !bound(i))
    };
    // Several workers on live ports: each reads and sends its own share of every port
    // (a socket of its own in each port's fanout group, or AF_XDP receive queues of its
    // own), unless the I/O thread must deal the packets (why, from `dealt_because`).
    let live_xdp = has_live(Driver::AfXdp);
    // Said before anything is opened: a user without the capabilities live ports need
    // would otherwise hear of those instead.
    if (live_xdp || has_live(Driver::AfPacket)) && (opts.looping || opts.rate.is_some()) {
        return Err(RunError::Inputs(
            "the service has live ports: --loop and --rate replay captures".into(),
        ));
    }
    let mut dealt_because = if live_xdp && program.conntrack.is_some() {
        Some(
            "the pipeline tracks connections and a port uses AF_XDP, whose sockets take the \
             frames of the receive queue the NIC's hash picked: the two directions of a \
             connection would not meet in one worker"
                .to_owned(),
        )
    } else if !opts.bindings.outputs.is_empty() {
        Some("a port writes a capture".to_owned())
    } else {
        None
    };
    let workers_for = |may_share: bool| match (opts.workers, &opts.cpus) {
        (Some(n), _) => n.max(1),
        (None, Some(cpus)) if may_share && cpus.len() > 1 => cpus.len(),
        (None, Some(cpus)) => cpus.len().saturating_sub(1).max(1),
        (None, None) => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    let code = Arc::new(Compiled::new(&program));
    let mut may_share = (has_live(Driver::AfPacket) || live_xdp) && dealt_because.is_none();
    let mut workers = workers_for(may_share);
    // An AF_XDP port's queues are dealt among the workers: each needs one at least.
    let few_queues = program.ports.iter().enumerate().find_map(|(i, p)| {
        let iface = p.iface.as_deref().unwrap_or_default();
        let queues = crate::io::af_xdp::receive_queues(iface);
        let few = p.driver == Driver::AfXdp && !bound(i) && (queues as usize) < workers;
        let absent = crate::sys::interface_index(iface).is_err();
        few.then(|| (p.name.clone(), iface.to_owned(), queues, absent))
    });
    if let Some((port, iface, queues, absent)) = few_queues.filter(|_| may_share && workers > 1) {
        dealt_because = Some(match absent {
            true => format!(
                "port {port}'s interface {iface} is not there, so its receive queues cannot \
                 be counted out to the {workers} workers (start once it exists for them to \
                 share it)"
            ),
            false => format!(
                "port {port}'s interface {iface} has {queues} receive queue(s), fewer than \
                 the {workers} workers, which would each read queues of their own (ethtool \
                 -L {iface} combined {workers})"
            ),
        });
        may_share = false;
        workers = workers_for(false);
    }
    // Tracked connections need both directions of each (and its ICMP errors and
    // fragments) in one worker's table: the kernel steers by the dealer's own choice,
    // a program of it, where it takes the program.
    let mut steering = None;
    if may_share && workers > 1 && program.conntrack.is_some() {
        match steering::KernelSteering::load(workers, code.tunnels()) {
            Ok(program) => steering = Some(program),
            Err(e) => {
                dealt_because = Some(format!(
                    "the pipeline tracks connections, whose two directions must meet in one \
                     worker, and the kernel refused the program that steers them there ({e})"
                ));
                may_share = false;
                workers = workers_for(false);
            }
        }
    }
    let shares = workers > 1 && may_share;
    let groups: Option<Vec<PortShares>> = if shares {
        let steered = steering.as_ref().map(steering::KernelSteering::fd);
        let groups = program.ports.iter().map(|p| match p.driver {
            Driver::AfXdp => Ok(PortShares::Xdp(XdpShares::new(workers))),
            _ => Fanout::new(workers, steered).map(PortShares::Fanout),
        });
        Some(
            groups
                .collect::<Result<_, _>>()
                .map_err(RunError::Steering)?,
        )
    } else {
        None
    };
    // The live ports of each thread that reads them: one, or with shares one a worker.
    let mut live_sets: Vec<Vec<Option<LivePort>>> = (0..if shares { workers } else { 1 })
        .map(|_| Vec::new())
        .collect();
    let mut unopened = Vec::new();
    // Per port: a live port waiting for its interface (`--wait-for-interfaces`).
    let mut waiting = Vec::new();
    let absent = |iface: &str| {
        crate::sys::interface_index(iface).is_err_and(|e| e.raw_os_error() == Some(libc::ENODEV))
    };
    for (i, port) in program.ports.iter().enumerate() {
        let iface = port.iface.as_deref().unwrap_or_default();
        let named = || {
            format!(
                "port {} uses driver {} (iface {iface})",
                port.name,
                port.driver.name()
            )
        };
        let is_live = matches!(port.driver, Driver::AfPacket | Driver::AfXdp) && !bound(i);
        let waits = is_live && !replays && opts.wait_for_interfaces && absent(iface);
        waiting.push(waits.then_some(Closed::NotYetOpened));
        let group = groups.as_ref().map(|g| &g[i]);
        let open = |member: usize| {
            let group = group.map(|g| (g, member));
            LivePort::open(PortId(i as u16), iface, port.driver, port.mtu, group)
        };
        let first = match port.driver {
            _ if waits => {
                tracing::warn!(
                    port = %port.name,
                    iface,
                    "no such interface yet: the port is opened once it exists"
                );
                None
            }
            Driver::AfPacket | Driver::AfXdp if !bound(i) && !replays => Some(open(0)?),
            Driver::AfPacket | Driver::AfXdp if !bound(i) => {
                unopened.push(format!(
                    "{}, not opened while the service replays captures",
                    named()
                ));
                None
            }
            Driver::Doca if !bound(i) => {
                unopened.push(format!(
                    "{}, which only the DOCA backend opens (not in this build: `dpuflow plan` \
                     shows what it would program)",
                    named()
                ));
                None
            }
            _ => None,
        };
        for (member, others) in live_sets.iter_mut().enumerate().skip(1) {
            others.push(match first {
                Some(_) => Some(open(member)?),
                None => None,
            });
        }
        live_sets[0].push(first);
    }
    let live = &live_sets[0];
    let absent_ports = waiting.iter().flatten().count();
    let lives = live.iter().flatten().count() + absent_ports;
    // A pipeline with a local service (the KV cache) is worth running without packets.
    if !replays && lives == 0 && program.services.is_empty() {
        let live = unopened.iter().map(|p| format!("; {p}")).collect();
        return Err(RunError::NoInput { live });
    }
    for port in &unopened {
        tracing::warn!(
            "{port}: it is neither read nor written (packets sent to it count as unsent)"
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        // A second signal ends the process at once, status 1, where a graceful stop takes
        // long (a million flows' last records at `ipfix_rate`): registered first, it sees
        // the flag the first signal set.
        signal_hook::flag::register_conditional_shutdown(sig, 1, Arc::clone(&stop))
            .map_err(RunError::Signals)?;
        signal_hook::flag::register(sig, Arc::clone(&stop)).map_err(RunError::Signals)?;
    }
    let hup = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&hup))
        .map_err(RunError::Signals)?;
    // Bound before any other thread starts: those this one starts inherit the CPUs of the
    // control threads, and the dataplane's bind themselves to theirs.
    let placement = match &opts.cpus {
        Some(dataplane) => {
            // With live ports and one worker, the I/O thread runs it; with shares, the
            // first runs worker 0 and the others one each.
            let threads = if lives > 0 && workers == 1 {
                0
            } else if shares {
                workers - 1
            } else {
                workers
            };
            let allowed = crate::sys::allowed_cpus().map_err(RunError::Affinity)?;
            let p = Placement::new(dataplane, threads, &allowed)?;
            crate::sys::bind_thread(&p.control).map_err(RunError::Affinity)?;
            let others = cpus::format(&p.control);
            if shares {
                let workers = cpus::format(&[&[p.io][..], &p.workers].concat());
                tracing::info!(workers, others, "threads bound to CPUs");
            } else {
                let workers = cpus::format(&p.workers);
                tracing::info!(io = p.io, workers, others, "threads bound to CPUs");
            }
            Some(p)
        }
        None => None,
    };
    // A long-running process: memory freed goes back to the system rather than staying
    // with the allocator (a KV-cache client's large values above all).
    crate::sys::map_large_allocations(LARGE_ALLOCATION);
    // Each KV-cache client holds a descriptor.
    let fd_limit = crate::sys::raise_fd_limit();
    if !program.services.is_empty() {
        match fd_limit {
            Ok(n) if n < crate::kvcache::server::MAX_CLIENTS + FDS_BESIDE_CLIENTS => {
                tracing::warn!(
                    limit = n,
                    "the open file limit leaves room for about {} KV-cache clients, not {} \
                     (raise LimitNOFILE or ulimit -n)",
                    n.saturating_sub(FDS_BESIDE_CLIENTS),
                    crate::kvcache::server::MAX_CLIENTS
                )
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot read or raise the open file limit"),
        }
    }
    // Services start first: a target that cannot be reached fails the command at once.
    let kv = program
        .services
        .iter()
        .map(|svc| match &svc.kind {
            ServiceKind::KvCache(c) => KvService::start(&svc.name, c, Arc::clone(&stop)),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let watch = Watch {
        stop: Arc::clone(&stop),
        failed: Arc::new(AtomicBool::new(false)),
    };
    let listener = match opts.metrics {
        Some(addr) => {
            Some(TcpListener::bind(addr).map_err(|source| RunError::Listen { addr, source })?)
        }
        None => None,
    };
    let conntrack_limit = program
        .conntrack
        .as_ref()
        .map(|c| c.capacity * workers as u64);
    enough_memory(&program, opts.ipfix.is_some(), workers)?;
    let notifier = Notifier::from_env().and_then(|n| {
        n.map_err(|e| tracing::warn!(error = %e, "the service manager's NOTIFY_SOCKET is unusable"))
            .ok()
    });
    let shared = Arc::new(Shared {
        info: Info {
            version: crate::VERSION.to_owned(),
            backend: "software",
            conntrack_limit,
            flow_limit: opts
                .ipfix
                .as_ref()
                .map(|_| program.telemetry.flow_cache * workers as u64),
        },
        snapshots: (0..workers)
            .map(|_| Mutex::new(Snapshot::default()))
            .collect(),
        export: opts.ipfix.as_ref().map(|_| ExportCounts::default()),
        live: lives > 0,
        workers_up: AtomicUsize::new(0),
        workers,
        failed: Arc::clone(&watch.failed),
        oversize: program.ports.iter().map(|_| Default::default()).collect(),
        ring_full: program.ports.iter().map(|_| Default::default()).collect(),
        port_open: (0..program.ports.len())
            .map(|i| AtomicBool::new(bound(i) || live[i].is_some()))
            .collect(),
        ports_waiting: AtomicUsize::new(absent_ports),
        groups,
        steered: steering.is_some(),
        port_closes: program.ports.iter().map(|_| Default::default()).collect(),
        unsent: program.ports.iter().map(|_| Default::default()).collect(),
        loaded: Mutex::new(Arc::new(Loaded::first(
            program,
            code,
            load_seconds,
            workers,
        ))),
        generation: AtomicU64::new(0),
        reloads: Reloads::default(),
        kv,
        dataplane_done: AtomicBool::new(false),
        beats: Beats::new(workers + 1),
        stalled: Mutex::new(None),
        notifier,
    });
    // Reading and checking the file left much free memory behind (a large table's text
    // and syntax tree).
    crate::sys::release_free_memory();
    let ports = shared.loaded().program.ports.len();
    // Open everything before any thread starts, so a bad file fails the command at once.
    let captures = if lives > 0 {
        None
    } else {
        Some(Merger::open(&opts.bindings.inputs)?)
    };
    let mut writers: Vec<Option<CaptureWriter>> = (0..ports).map(|_| None).collect();
    for (port, path) in &opts.bindings.outputs {
        writers[port.index()] = Some(CaptureWriter::create(path)?);
    }
    // The address bound: with port 0, the one the kernel chose.
    if let Some(addr) = listener.as_ref().and_then(|l| l.local_addr().ok()) {
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    }
    for port in live.iter().flatten() {
        tracing::info!(
            iface = port.iface(),
            driver = port.driver(),
            mode = %port.mode(),
            "live port open"
        );
    }
    match dealt_because {
        _ if shares && steering.is_some() => tracing::info!(
            workers,
            "each worker reads and sends its own share of the live ports (AF_PACKET \
             fanout, steered by a program of the dealer's choice: a connection's two \
             directions, its ICMP errors and fragments meet in one worker)"
        ),
        _ if shares => tracing::info!(
            workers,
            "each worker reads and sends its own share of the live ports (AF_PACKET: \
             fanout by flow; AF_XDP: receive queues of its own)"
        ),
        Some(why) if lives > 0 && workers > 1 => {
            tracing::info!("the I/O thread deals the live ports' packets to the workers: {why}")
        }
        _ => {}
    }
    tracing::info!(pipeline = %shared.loaded().program.name, workers, inputs = opts.bindings.inputs.len() + lives, "running");

    let (flows_tx, flows_rx) = bounded::<Vec<FlowRecord>>(QUEUE * workers);
    let exporter = match &opts.ipfix {
        Some(to) => {
            let mut collector = Collector::open(to).map_err(|source| RunError::Listen {
                addr: to.address,
                source,
            })?;
            let sampling = shared.loaded().program.telemetry.sampling;
            tracing::info!(collector = %to.address, sampling, "exporting IPFIX");
            let shared = Arc::clone(&shared);
            Some(watch.spawn("ipfix", move || export(&mut collector, &flows_rx, &shared))?)
        }
        None => None,
    };
    let flows_tx = opts.ipfix.as_ref().map(|_| flows_tx);
    // The threads that read and write packets (each with the worker it runs, if any)…
    let mut dataplane = Vec::new();
    // … and the worker threads they deal to.
    let mut handles = Vec::new();
    let spawn_io = |name: &str, cpu: Option<usize>, source, ports, ends| {
        let (stop, failing) = (Arc::clone(&stop), watch.clone());
        let (opts, shared) = (opts.clone(), Arc::clone(&shared));
        watch.spawn(name, move || {
            bind_to(cpu);
            let done = io(source, &opts, ports, ends, &shared, &stop);
            shared.dataplane_done.store(true, Ordering::Relaxed);
            // A dataplane that can no longer read or write is stopped as a failed thread
            // is, not left serving metrics as if ready; the stop flushes what it can.
            if let Err(e) = &done {
                tracing::error!(error = %e, "reading or writing packets failed; stopping the service");
                failing.fail();
            }
            done
        })
    };
    if shares {
        // Each worker runs in the thread that reads and sends its share: no hand-off.
        for (w, live) in live_sets.into_iter().enumerate() {
            let (tx, rx) = bounded::<Vec<PacketBuf>>(QUEUE);
            let (spare_tx, spare_rx) = bounded::<Vec<PacketBuf>>(QUEUE);
            let (done_tx, done_rx) = bounded::<Processed>(QUEUE);
            let channels = WorkerChannels {
                rx,
                done: done_tx,
                spares: spare_rx,
                flows: flows_tx.clone(),
                index: 0,
            };
            let ends = IoEnds {
                to_workers: vec![tx],
                done: done_rx,
                spares_back: vec![spare_tx],
                inline: Some((w, channels)),
            };
            let source = Source::Live(readable(&live));
            let ports = StartingPorts {
                writers: (0..ports).map(|_| None).collect(),
                live,
                waiting: waiting.clone(),
            };
            let cpu = placement
                .as_ref()
                .map(|p| if w == 0 { p.io } else { p.workers[w - 1] });
            dataplane.push(spawn_io(&format!("worker-{w}"), cpu, source, ports, ends)?);
        }
    } else {
        let (done_tx, done_rx) = bounded::<Processed>(QUEUE * workers);
        let mut to_workers = Vec::new();
        let mut spares_back = Vec::new();
        // With live ports and one worker, the I/O thread runs the worker itself: handing
        // each small batch to another thread and back cost more than the batch
        // (docs/benchmarks.md).
        let mut inline = None;
        for w in 0..workers {
            let (tx, rx) = bounded::<Vec<PacketBuf>>(QUEUE);
            to_workers.push(tx);
            let (spare_tx, spare_rx) = bounded::<Vec<PacketBuf>>(QUEUE);
            spares_back.push(spare_tx);
            let channels = WorkerChannels {
                rx,
                done: done_tx.clone(),
                spares: spare_rx,
                flows: flows_tx.clone(),
                index: w,
            };
            if lives > 0 && workers == 1 {
                inline = Some((w, channels));
                continue;
            }
            let cpu = placement.as_ref().map(|p| p.workers[w]);
            let shared = Arc::clone(&shared);
            handles.push(watch.spawn(&format!("worker-{w}"), move || {
                bind_to(cpu);
                worker(w, &shared, channels)
            })?);
        }
        let ends = IoEnds {
            to_workers,
            done: done_rx,
            spares_back,
            inline,
        };
        let source = match captures {
            Some(merger) => Source::Captures(merger),
            None => Source::Live(readable(&live_sets[0])),
        };
        let ports = StartingPorts {
            writers,
            live: live_sets.swap_remove(0),
            waiting,
        };
        let cpu = placement.as_ref().map(|p| p.io);
        dataplane.push(spawn_io("io", cpu, source, ports, ends)?);
    }
    drop(flows_tx);

    let reloader = {
        let (stop, shared, file) = (
            Arc::clone(&stop),
            Arc::clone(&shared),
            opts.pipeline.clone(),
        );
        watch.spawn("control", move || control(&file, &hup, &stop, &shared))?
    };
    // Serve metrics until signalled; without an endpoint, until the inputs are done.
    match &listener {
        Some(l) => http::serve(l, &stop, &*shared).map_err(|e| RunError::Thread(e.to_string()))?,
        None => {
            let serving = !shared.kv.is_empty();
            let running = || !dataplane.iter().all(JoinHandle::is_finished);
            while !stop.load(Ordering::Relaxed) && (serving || running()) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(n) = &shared.notifier {
        let _ = n.send(&format!(
            "STOPPING=1\n{}",
            notify::status(
                "stopping: finishing the batches read, flushing outputs, exporting the last flows"
            )
        ));
    }
    for kv in &shared.kv {
        kv.shutdown();
    }
    // Every thread is joined, even after one failed: the others finish what they hold, the
    // outputs are flushed and the final IPFIX export is sent.
    // A reload in progress is left to the process's end: a stop does not wait for it.
    drop(reloader);
    let io: Vec<_> = dataplane.into_iter().map(JoinHandle::join).collect();
    let workers_done = handles.into_iter().all(|h| h.join().is_ok());
    let sent = exporter.map(JoinHandle::join);
    let (mut read, mut unsent) = (0, 0);
    for done in io {
        let (r, u) =
            done.map_err(|_| RunError::Thread("a thread reading packets panicked".into()))??;
        (read, unsent) = (read + r, unsent + u);
    }
    if !workers_done {
        return Err(RunError::Thread("a worker panicked".into()));
    }
    if let Some(sent) = sent {
        let sent = sent.map_err(|_| RunError::Thread("the IPFIX exporter panicked".into()))?;
        tracing::info!(records = sent, "IPFIX export done");
    }
    tracing::info!(packets = read, unsent, "stopped");
    Ok(())
}

/// Binds the calling thread to `cpu`, if given. A failure (the CPU was taken away since
/// the start, by a cpuset) leaves it where it was, said.
fn bind_to(cpu: Option<usize>) {
    if let Some(cpu) = cpu {
        if let Err(e) = crate::sys::bind_thread(&[cpu]) {
            tracing::warn!(cpu, error = %e, "thread left unbound");
        }
    }
}

/// The control thread, until `stop`: judges whether the dataplane's threads go on
/// ([`liveness`]), keeps the service manager told ([`Told`]), and reloads: on each
/// SIGHUP (`hup` set), once every worker runs the pipeline of the reload before, loads
/// `file` again and publishes it, or logs why not and keeps the running one.
fn control(file: &PipelineFile, hup: &AtomicBool, stop: &AtomicBool, shared: &Shared) {
    // The reload published and not yet taken by every worker, and when it was published.
    let mut pending = None::<(u64, Instant)>;
    // The reload being read, checked and compiled, in a thread of its own so that this
    // one goes on judging the dataplane and feeding the watchdog meanwhile (a
    // million-entry table takes seconds), with the pipeline it follows.
    let mut loading = None::<(JoinHandle<Result<Loaded, ReloadError>>, Arc<Loaded>)>;
    let mut liveness = Liveness::new(shared.workers + 1, Instant::now());
    let mut told = Told::new(shared.notifier.as_ref());
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(reload::POLL);
        judge(shared, &mut liveness);
        told.update(shared);
        if let Some((generation, at)) = pending.filter(|&(g, _)| shared.workers_run(g)) {
            // No worker runs the previous program now: what it held is free.
            crate::sys::release_free_memory();
            let longest = shared.reloads.longest_swap_ns.swap(0, Ordering::Relaxed);
            tracing::info!(
                generation,
                seconds = at.elapsed().as_secs_f64(),
                longest_pause_seconds = longest as f64 * 1e-9,
                "every worker runs the reloaded pipeline"
            );
            pending = None;
        }
        if let Some((thread, current)) = loading.take() {
            if !thread.is_finished() {
                loading = Some((thread, current));
                continue;
            }
            // A panic there is the service's, as it was when reloads ran here.
            let next = thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            if let Some(generation) = take_reload(next, &current, file, shared) {
                pending = Some((generation, Instant::now()));
            }
            // Ready again, said with the status the reload left.
            told.ready = false;
            told.update(shared);
            continue;
        }
        if !hup.load(Ordering::Relaxed) {
            continue;
        }
        if shared.dataplane_done.load(Ordering::Relaxed) {
            hup.store(false, Ordering::Relaxed);
            tracing::warn!("reload ignored: the inputs are done, no packets run");
            continue;
        }
        let current = shared.loaded();
        if !shared.workers_run(current.generation) {
            continue;
        }
        hup.store(false, Ordering::Relaxed);
        told.send("RELOADING=1");
        let (to_load, from, workers) = (file.clone(), Arc::clone(&current), shared.workers);
        let thread = std::thread::Builder::new()
            .name("reload".to_owned())
            .spawn(move || reload::load_next(&to_load, &from, workers));
        match thread {
            Ok(thread) => loading = Some((thread, current)),
            Err(e) => {
                take_reload(Err(ReloadError::Thread(e)), &current, file, shared);
                told.ready = false;
                told.update(shared);
            }
        }
    }
}

/// Publishes the pipeline a reload made from `current` for the workers to take (after
/// steering the kernel's fanout by its tunnel ports, where it steers), or logs why it
/// was refused; counts either. The generation published, if one was.
fn take_reload(
    next: Result<Loaded, ReloadError>,
    current: &Loaded,
    file: &PipelineFile,
    shared: &Shared,
) -> Option<u64> {
    let counts = &shared.reloads;
    let next = next.and_then(|next| {
        shared.steer_for(current, &next).map_err(|e| {
            ReloadError::Steering(format!(
                "the kernel refused the program that steers the new tunnel ports' \
                 connections to their workers: {e}"
            ))
        })?;
        Ok(next)
    });
    match next {
        Ok(next) => {
            let (generation, seconds) = (next.generation, next.seconds);
            let (pipes, entries) = (next.program.pipes.len(), next.program.entry_count());
            *shared.loaded.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
            shared.generation.store(generation, Ordering::Release);
            counts.succeeded.fetch_add(1, Ordering::Relaxed);
            counts.last_failed.store(false, Ordering::Relaxed);
            tracing::info!(
                path = %file.path.display(),
                generation,
                pipes,
                entries,
                seconds,
                "pipeline reloaded"
            );
            Some(generation)
        }
        Err(e) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            counts.last_failed.store(true, Ordering::Relaxed);
            tracing::error!(path = %file.path.display(), "reload refused, the running pipeline kept: {e}");
            None
        }
    }
}

/// Notes which dataplane threads are stalled (see [`liveness`]), for `/healthz` and the
/// watchdog, and logs when that changes. The threads are judged while they all run:
/// not while the workers start, nor once the inputs are done.
fn judge(shared: &Shared, liveness: &mut Liveness) {
    let now = Instant::now();
    let running = shared.workers_up.load(Ordering::Relaxed) == shared.workers
        && !shared.dataplane_done.load(Ordering::Relaxed);
    let stalled = if running {
        // Where each worker reads its own share, there is no I/O thread: its slot is
        // shared by the workers' reading, and each worker's own slot tells.
        let judged = |slot| slot < shared.workers || shared.groups.is_none();
        liveness.observe(shared.beats.counts(), judged, now)
    } else {
        liveness.restart(now);
        Vec::new()
    };
    let name = |slot| match slot {
        s if s == shared.workers => "io".to_owned(),
        s => format!("worker-{s}"),
    };
    let said = (!stalled.is_empty()).then(|| {
        let threads: Vec<_> = stalled.iter().map(|&(slot, _)| name(slot)).collect();
        let detail: Vec<_> = stalled
            .iter()
            .map(|&(slot, stood)| {
                format!(
                    "{} (no progress for {:.1} s)",
                    name(slot),
                    stood.as_secs_f64()
                )
            })
            .collect();
        Stalled {
            count: threads.len(),
            threads: threads.join(", "),
            detail: format!("dataplane stalled: {}", detail.join(", ")),
        }
    });
    let mut now_said = shared.stalled.lock().unwrap_or_else(|e| e.into_inner());
    match (&*now_said, &said) {
        (None, Some(s)) => tracing::error!(
            "{}; /healthz fails and a service manager's watchdog is no longer fed",
            s.detail
        ),
        (Some(_), None) => tracing::info!("the dataplane goes on again"),
        _ => {}
    }
    *now_said = said;
}

/// What the service manager has been told, and what it is told next (see [`notify`]):
/// `READY=1` once every worker runs (ports whose interfaces are awaited are awaited
/// then, said in the status), the status line as it changes, `WATCHDOG=1` as often as
/// the manager asked while no dataplane thread is stalled.
struct Told<'n> {
    notifier: Option<&'n Notifier>,
    ready: bool,
    status: String,
    fed: Option<Instant>,
    /// A failed send has been logged (it is logged once).
    failed: bool,
}

impl<'n> Told<'n> {
    fn new(notifier: Option<&'n Notifier>) -> Told<'n> {
        Told {
            notifier,
            ready: false,
            status: String::new(),
            fed: None,
            failed: false,
        }
    }

    fn update(&mut self, shared: &Shared) {
        let Some(notifier) = self.notifier else {
            return;
        };
        if shared.workers_up.load(Ordering::Relaxed) < shared.workers {
            return;
        }
        let mut lines = Vec::new();
        if !self.ready {
            self.ready = true;
            lines.push("READY=1".to_owned());
        }
        let status = shared.status();
        if status != self.status {
            lines.push(notify::status(&status));
            self.status = status;
        }
        let healthy = shared.unhealthy().is_none();
        if let Some(every) = notifier.watchdog().filter(|_| healthy) {
            if self.fed.is_none_or(|at| at.elapsed() >= every) {
                self.fed = Some(Instant::now());
                lines.push("WATCHDOG=1".to_owned());
            }
        }
        if !lines.is_empty() {
            self.send(&lines.join("\n"));
        }
    }

    fn send(&mut self, state: &str) {
        let Some(notifier) = self.notifier else {
            return;
        };
        if let Err(e) = notifier.send(state) {
            if !std::mem::replace(&mut self.failed, true) {
                tracing::warn!(error = %e, "cannot tell the service manager how the service stands");
            }
        }
    }
}

/// Starts the service's threads. A thread that panics stops the service, which then exits
/// with an error: a dataplane short of a worker would otherwise go on serving its metrics,
/// healthy and ready, while the packets it was dealt went nowhere. (Under systemd,
/// `Restart=on-failure` starts it afresh.)
#[derive(Debug, Clone)]
struct Watch {
    stop: Arc<AtomicBool>,
    failed: Arc<AtomicBool>,
}

impl Watch {
    /// Stops the service as failed: not ready from now on, and an error at the end.
    fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
        self.stop.store(true, Ordering::Relaxed);
    }

    fn spawn<T: Send + 'static>(
        &self,
        name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<JoinHandle<T>, RunError> {
        let tripwire = Tripwire {
            name: name.to_owned(),
            watch: self.clone(),
        };
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let _armed = tripwire;
                f()
            })
            .map_err(|e| RunError::Thread(e.to_string()))
    }
}

/// Dropped when its thread ends; if that is by a panic, stops the service.
struct Tripwire {
    name: String,
    watch: Watch,
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!(thread = %self.name, "thread panicked; stopping the service");
            self.watch.fail();
        }
    }
}

/// Deals packets to workers, as [`steering::pick`] says.
struct Dealer<'a> {
    shared: &'a Shared,
    /// The pipeline whose tunnels the dealer parses, and its generation.
    code: Arc<Compiled>,
    generation: u64,
    workers: usize,
    /// The worker each recent datagram's first fragment went to: its later fragments,
    /// without ports to hash, follow it to its connection.
    fragments: Fragments<u16>,
    /// The packet being dealt, parsed in place (a `Meta` returned by value was copied
    /// out for every packet).
    meta: parse::Meta,
}

impl Dealer<'_> {
    fn pick(&mut self, pkt: &PacketBuf) -> usize {
        if self.workers == 1 {
            return 0;
        }
        // A reload may have changed which UDP ports carry tunnels.
        if self.shared.generation.load(Ordering::Relaxed) != self.generation {
            let loaded = self.shared.loaded();
            (self.code, self.generation) = (Arc::clone(&loaded.code), loaded.generation);
        }
        if parse::parse_into(pkt.data(), self.code.tunnels(), &mut self.meta).is_err() {
            return 0;
        }
        steering::pick(
            pkt.data(),
            &self.meta,
            &mut self.fragments,
            pkt.ts_ns,
            self.workers,
        )
    }
}

/// The I/O thread's ends of the channels.
struct IoEnds {
    to_workers: Vec<Sender<Vec<PacketBuf>>>,
    /// Processed batches from every worker.
    done: Receiver<Processed>,
    /// Mirror-copy buffers back to each worker.
    spares_back: Vec<Sender<Vec<PacketBuf>>>,
    /// The only worker (its number, and its ends), when the I/O thread runs it itself.
    inline: Option<(usize, WorkerChannels)>,
}

/// Where the I/O thread reads packets from.
enum Source {
    /// Capture files, merged in timestamp order.
    Captures(Merger),
    /// The live ports (kept in [`Outputs::live`], which sends through them too), and the
    /// wait for any of them to have a frame.
    Live(Readable),
}

/// What the I/O thread read next.
enum Read {
    /// A packet, in the slot.
    Packet,
    /// A frame larger than the packet buffers (or a live port's ring slots) arrived on
    /// this port (the slot holds nothing).
    Oversize(PortId, usize),
    /// No live port has a frame waiting.
    Idle,
    /// The captures are read to their end.
    End,
}

/// How long the I/O thread waits for live ports at a time (it checks for a stop in
/// between).
const IDLE_WAIT: Duration = Duration::from_millis(10);

/// The I/O thread: reads the inputs into batches for the workers until they end (or, with
/// `--loop` or live ports, until `stop`), writing the batches the workers send back as
/// they come; then writes the rest and flushes the outputs. Returns the packets read and
/// those forwarded to a port without an output.
fn io(
    mut source: Source,
    opts: &Options,
    ports: StartingPorts,
    ends: IoEnds,
    shared: &Shared,
    stop: &AtomicBool,
) -> Result<(u64, u64), RunError> {
    let IoEnds {
        to_workers,
        done,
        spares_back,
        inline,
    } = ends;
    let member = inline.as_ref().map_or(0, |(w, _)| *w);
    let mut inline = inline.map(|(w, ch)| Worker::new(w, shared, ch));
    let StartingPorts {
        writers,
        live,
        waiting,
    } = ports;
    let ports = live.len();
    let mut out = Outputs {
        writers,
        live,
        unsent: vec![0; ports],
        published: vec![0; ports],
        waiting,
        member,
        to_wall: if shared.live { live_clock_to_wall() } else { 0 },
        returned: 0,
        pool: Vec::new(),
        batches: Vec::new(),
        spares_back,
        tx_warning: WarnThrottle::default(),
        reopen_warning: WarnThrottle::default(),
    };
    let (n, batch) = (to_workers.len(), opts.batch.max(1));
    let loaded = shared.loaded();
    let mut dealer = Dealer {
        shared,
        code: Arc::clone(&loaded.code),
        generation: loaded.generation,
        workers: n,
        fragments: Fragments::default(),
        meta: parse::Meta::default(),
    };
    // Buffers made so far, and the most there may be: beyond it, a packet waits for a
    // processed batch's buffers (see `batches_in_flight`).
    let (mut made, limit) = (0usize, batches_in_flight(n) * batch);
    let mut current: Vec<Vec<PacketBuf>> = (0..n).map(|_| Vec::with_capacity(batch)).collect();
    let (mut read, mut offset, mut first, mut last) = (0u64, 0u64, None::<u64>, 0u64);
    // Batches handed to the workers (those not yet back are `sent - out.returned`).
    let mut sent = 0u64;
    // The live port read next, so that every port gets its turn.
    let mut turn = 0usize;
    // When the ports were last looked at (see `look_at_ports`).
    let mut ports_checked = Instant::now();
    let start = Instant::now();
    let mut slot = PacketBuf::new(DEFAULT_MAX_FRAME);
    let mut workers_gone = false;
    let mut oversize_warning = WarnThrottle::default();
    // This thread's rounds: a batch handed over, a wait, a paced or skipped packet.
    let beat = || shared.beats.beat(shared.workers);
    while !stop.load(Ordering::Relaxed) && !workers_gone {
        let next = match &mut source {
            Source::Captures(merger) => match merger.next(&mut slot)? {
                None if opts.looping && read > 0 => {
                    // Again from the start, later in time by the length of one pass.
                    offset += last.saturating_sub(first.unwrap_or(last)) + 1_000_000;
                    first = None;
                    merger.rewind()?;
                    continue;
                }
                None => Read::End,
                Some(Merged::Oversize(port, len)) => Read::Oversize(port, len),
                Some(Merged::Packet) => Read::Packet,
            },
            Source::Live(_) => receive_live(&mut out.live, &mut turn, &mut slot),
        };
        match next {
            Read::End => break,
            Read::Idle => {
                beat();
                if ports_checked.elapsed() >= PUBLISH_EVERY {
                    look_at_ports(&mut out, &mut source, shared);
                    ports_checked = Instant::now();
                }
                // Nothing waits: what was read goes to the workers now rather than when
                // its batch fills, and out again before the wait.
                for (w, b) in current.iter_mut().enumerate() {
                    if !b.is_empty() {
                        let empty = out
                            .batches
                            .pop()
                            .unwrap_or_else(|| Vec::with_capacity(batch));
                        workers_gone |=
                            !send(&to_workers[w], std::mem::replace(b, empty), &done, &mut out)?;
                        sent += 1;
                    }
                }
                pump(&mut inline);
                while out.returned < sent {
                    match done.recv_timeout(IDLE_WAIT) {
                        Ok(p) => out.write(p)?,
                        Err(_) => break,
                    }
                }
                // What a busy transmit queue left unsent goes before the wait.
                out.flush_live();
                if let Source::Live(readable) = &mut source {
                    let ports = &out.live;
                    // A link that went down: said, and the port reads again once it is up.
                    let said = |i: usize, e: std::io::Error| {
                        let mut by_fd = ports
                            .iter()
                            .flatten()
                            .flat_map(|p| p.fds().into_iter().map(move |_| p));
                        if let Some(port) = by_fd.nth(i) {
                            tracing::warn!(iface = port.iface(), error = %e, "live port");
                        }
                    };
                    readable
                        .wait(IDLE_WAIT, said)
                        .map_err(|e| RunError::Thread(e.to_string()))?;
                }
                continue;
            }
            Read::Oversize(port, len) => {
                // A capture of nothing else goes round without a batch.
                beat();
                let [packets, bytes] = &shared.oversize[port.index()];
                packets.fetch_add(1, Ordering::Relaxed);
                bytes.fetch_add(len as u64, Ordering::Relaxed);
                if oversize_warning.ready() {
                    tracing::warn!(
                        port = %loaded.program.ports[port.index()].name,
                        bytes = len,
                        largest = DEFAULT_MAX_FRAME,
                        "frame larger than the packet buffers skipped (counted as dropped: oversize)"
                    );
                }
                continue;
            }
            Read::Packet => {}
        }
        first.get_or_insert(slot.ts_ns);
        last = slot.ts_ns;
        slot.ts_ns += offset;
        read += 1;
        // Ports busy enough never to be idle are looked at as they go.
        if read % LOOK_AT_PORTS_EVERY == 0 {
            look_at_ports(&mut out, &mut source, shared);
        }
        let w = dealer.pick(&slot);
        let fresh = match out.pool.pop() {
            Some(b) => b,
            None if made < limit => {
                made += 1;
                PacketBuf::new(DEFAULT_MAX_FRAME)
            }
            None => {
                pump(&mut inline);
                match done.recv() {
                    Ok(p) => {
                        out.write(p)?;
                        out.pool
                            .pop()
                            .expect("a processed batch returns its buffers")
                    }
                    // Every worker is gone (none runs without the I/O thread's batches).
                    Err(_) => break,
                }
            }
        };
        current[w].push(std::mem::replace(&mut slot, fresh));
        if current[w].len() == batch {
            let empty = out
                .batches
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(batch));
            let full = std::mem::replace(&mut current[w], empty);
            workers_gone = !send(&to_workers[w], full, &done, &mut out)?;
            sent += 1;
            beat();
            pump(&mut inline);
            // Whatever the workers have finished is written now, not when its buffers are
            // next needed: outputs keep up, and fewer buffers circulate.
            while let Ok(p) = done.try_recv() {
                out.write(p)?;
            }
        }
        if let Some(pps) = opts.rate {
            beat();
            let due = Duration::from_secs_f64(read as f64 / pps as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    for (w, b) in current.into_iter().enumerate() {
        if !b.is_empty() && !send(&to_workers[w], b, &done, &mut out)? {
            break;
        }
        pump(&mut inline);
    }
    // The workers finish what they hold once their channels close (the one this thread
    // runs, now).
    drop(to_workers);
    if let Some(w) = inline {
        w.finish();
    }
    for p in done.iter() {
        out.write(p)?;
    }
    out.publish(shared);
    for w in out.writers.into_iter().flatten() {
        w.finish()?;
    }
    Ok((read, out.unsent.iter().sum()))
}

/// Packets read between two looks at the live ports while traffic flows.
const LOOK_AT_PORTS_EVERY: u64 = 1 << 16;

/// The I/O thread's look at the ports, every tenth of a second while they are quiet and
/// every [`LOOK_AT_PORTS_EVERY`] packets while they are not. It publishes the unsent
/// counts; notes how the live ports' clock stands to the wall clock (for capture
/// outputs); adds what the live ports' receive rings dropped since the last look to the
/// ports' counts (one getsockopt a port); closes a live port whose interface was removed
/// (one interface lookup a port), as its socket would never see another frame, even from
/// an interface made again under the name (an AF_XDP socket is not even told), or an
/// AF_XDP port whose interface's receive queues changed (a new queue's frames would go
/// around the pipeline: one directory read a port); and opens such a port again once an
/// interface of its name is there.
fn look_at_ports(out: &mut Outputs, source: &mut Source, shared: &Shared) {
    out.publish(shared);
    if shared.live {
        out.to_wall = live_clock_to_wall();
    }
    let mut changed = false;
    for (i, slot) in out.live.iter_mut().enumerate() {
        if let Some(port) = slot {
            let dropped = port.ring_drops();
            if dropped > 0 {
                shared.ring_full[i].fetch_add(dropped, Ordering::Relaxed);
            }
            let closing = if port.removed() {
                Some(Closing::InterfaceRemoved)
            } else if port.queues_changed() {
                Some(Closing::QueuesChanged)
            } else {
                None
            };
            let Some(closing) = closing else {
                continue;
            };
            // A port the workers share closes once: with its first socket to go.
            let group = shared.groups.as_ref().map(|g| &g[i]);
            let first = match (group, port.group()) {
                (Some(g), Some(joined)) => g.leave(joined.id),
                _ => true,
            };
            if first {
                shared.port_closes[i][closing as usize].fetch_add(1, Ordering::Relaxed);
                match closing {
                    Closing::InterfaceRemoved => tracing::warn!(
                        iface = port.iface(),
                        "interface removed: its port is closed until an interface of that \
                         name is back (frames for it are dropped, counted unsent)"
                    ),
                    Closing::QueuesChanged => tracing::warn!(
                        iface = port.iface(),
                        "the interface's receive queues changed: its port is opened again \
                         on them"
                    ),
                }
                shared.ports_waiting.fetch_add(1, Ordering::Relaxed);
                shared.port_open[i].store(false, Ordering::Relaxed);
            }
            *slot = None;
            out.waiting[i] = Some(Closed::Reopening);
            changed = true;
        }
        if let Some(closed) = out.waiting[i] {
            let loaded = shared.loaded();
            let spec = &loaded.program.ports[i];
            let iface = spec.iface.as_deref().unwrap_or_default();
            if crate::sys::interface_index(iface).is_err() {
                continue;
            }
            let group = shared.groups.as_ref().map(|g| (&g[i], out.member));
            match LivePort::open(PortId(i as u16), iface, spec.driver, spec.mtu, group) {
                Ok(port) => {
                    // A shared port opens once: with the socket that starts its group.
                    if port.group().is_none_or(|joined| joined.started) {
                        let said = match closed {
                            Closed::NotYetOpened => "live port open",
                            Closed::Reopening => "live port open again",
                        };
                        let (driver, mode) = (port.driver(), port.mode());
                        tracing::info!(iface, driver, %mode, "{said}");
                        shared.port_open[i].store(true, Ordering::Relaxed);
                        shared.ports_waiting.fetch_sub(1, Ordering::Relaxed);
                    }
                    *slot = Some(port);
                    out.waiting[i] = None;
                    changed = true;
                }
                Err(e) => {
                    if out.reopen_warning.ready() {
                        tracing::warn!(error = %e, "live port not yet open again");
                    }
                }
            }
        }
    }
    if let (true, Source::Live(readable_now)) = (changed, source) {
        *readable_now = readable(&out.live);
    }
}

/// What to wait on for frames from the live ports open.
fn readable(live: &[Option<LivePort>]) -> Readable {
    let fds: Vec<_> = live.iter().flatten().flat_map(LivePort::fds).collect();
    Readable::new(&fds)
}

/// Reads a frame from the live ports, each in turn from `turn` on, stamped with their
/// clock ([`live_clock_ns`]); [`Read::Idle`] when none has one waiting.
fn receive_live(live: &mut [Option<LivePort>], turn: &mut usize, slot: &mut PacketBuf) -> Read {
    let now = live_clock_ns();
    for _ in 0..live.len() {
        let i = *turn;
        *turn = (i + 1) % live.len();
        let Some(port) = &mut live[i] else { continue };
        match port.receive(slot, now) {
            Some(Received::Frame) => return Read::Packet,
            Some(Received::Oversize(len)) => return Read::Oversize(PortId(i as u16), len),
            None => {}
        }
    }
    Read::Idle
}

/// Sends a batch to a worker, writing the processed batches that arrive while its channel
/// is full; `false` when the worker is gone.
fn send(
    to: &Sender<Vec<PacketBuf>>,
    batch: Vec<PacketBuf>,
    done: &Receiver<Processed>,
    out: &mut Outputs,
) -> Result<bool, RunError> {
    let mut batch = batch;
    loop {
        match to.try_send(batch) {
            Ok(()) => return Ok(true),
            Err(TrySendError::Disconnected(_)) => return Ok(false),
            Err(TrySendError::Full(b)) => batch = b,
        }
        // The worker is [`QUEUE`] batches behind: it makes room as it takes the next,
        // just after handing one back, so the wait is for a processed batch (or a moment,
        // to look again). Not a select over both: that builds its list of operations each
        // time, an allocation a batch while the workers are the bottleneck.
        match done.recv_timeout(ROOM_WAIT) {
            Ok(p) => out.write(p)?,
            Err(RecvTimeoutError::Timeout) => {}
            // No worker left to send anything back: this one is gone too.
            Err(RecvTimeoutError::Disconnected) => return Ok(false),
        }
    }
}

/// How long [`send`] waits for a processed batch before it looks for room again.
const ROOM_WAIT: Duration = Duration::from_millis(1);

/// The ports the I/O thread starts with, by port.
struct StartingPorts {
    /// Capture outputs.
    writers: Vec<Option<CaptureWriter>>,
    /// Live ports open.
    live: Vec<Option<LivePort>>,
    /// Live ports waiting for their interface.
    waiting: Vec<Option<Closed>>,
}

/// Why a live port was closed to be opened again; its value is the index of its name in
/// [`metrics::PORT_CLOSE_REASONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closing {
    InterfaceRemoved = 0,
    /// An AF_XDP port's interface's receive queues changed.
    QueuesChanged = 1,
}

/// Why a live port is not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Closed {
    /// Its interface did not exist at the start (`--wait-for-interfaces`).
    NotYetOpened,
    /// Its interface was removed, or its receive queues changed.
    Reopening,
}

/// Where processed batches go: their forwarded packets to the output files or live ports,
/// their buffers back to the reading (and the mirror copies' to their worker).
struct Outputs {
    writers: Vec<Option<CaptureWriter>>,
    /// The live ports, by port.
    live: Vec<Option<LivePort>>,
    /// Per port: packets forwarded to it that went nowhere (no output bound, its live
    /// interface gone, or it could not send them).
    unsent: Vec<u64>,
    /// `unsent` as last added to the metrics' counts.
    published: Vec<u64>,
    /// Per port: a live port not open, to be opened once it can.
    waiting: Vec<Option<Closed>>,
    /// Which member of the ports' fanout groups this thread is (the worker it runs), when
    /// the workers share the ports.
    member: usize,
    /// What moves a packet's time onto the wall clock as it is written: with live ports,
    /// [`live_clock_to_wall`] as last looked at; a replay writes its captures' times.
    to_wall: i64,
    /// Processed batches written.
    returned: u64,
    /// Packet buffers free for reading into.
    pool: Vec<PacketBuf>,
    /// Empty batches to fill.
    batches: Vec<Vec<PacketBuf>>,
    spares_back: Vec<Sender<Vec<PacketBuf>>>,
    tx_warning: WarnThrottle,
    reopen_warning: WarnThrottle,
}

impl Outputs {
    fn write(&mut self, mut batch: Processed) -> Result<(), RunError> {
        self.returned += 1;
        for pkt in batch.packets.iter().chain(&batch.mirrors) {
            if let Verdict::Forward(port) = pkt.verdict {
                let i = port.index();
                if let Some(w) = &mut self.writers[i] {
                    w.write(pkt.ts_ns.saturating_add_signed(self.to_wall), pkt.data())?;
                } else if let Some(live) = &mut self.live[i] {
                    let sent = live.send(pkt.data());
                    if !matches!(sent, Sent::Yes) {
                        self.unsent[i] += 1;
                        if self.tx_warning.ready() {
                            match sent {
                                Sent::Refused(e) => tracing::warn!(
                                    iface = live.iface(),
                                    error = %e,
                                    "send failed: frame dropped"
                                ),
                                _ => tracing::warn!(
                                    iface = live.iface(),
                                    "transmit queue full: frame dropped"
                                ),
                            }
                        }
                    }
                } else {
                    self.unsent[i] += 1;
                }
            }
        }
        self.flush_live();
        self.pool.append(&mut batch.packets);
        self.batches.push(batch.packets);
        if !batch.mirrors.is_empty() {
            let _ = self.spares_back[batch.worker].try_send(batch.mirrors);
        }
        Ok(())
    }

    /// Hands the live ports what was sent through them (AF_XDP queues frames until then).
    fn flush_live(&mut self) {
        for (live, unsent) in self.live.iter_mut().zip(&mut self.unsent) {
            let Some(live) = live else { continue };
            match live.flush() {
                Ok(0) => {}
                Ok(dropped) => {
                    *unsent += dropped as u64;
                    if self.tx_warning.ready() {
                        tracing::warn!(
                            iface = live.iface(),
                            dropped,
                            "interface down: frames dropped"
                        );
                    }
                }
                Err(e) => {
                    if self.tx_warning.ready() {
                        tracing::warn!(iface = live.iface(), error = %e, "send failed: frames wait");
                    }
                }
            }
        }
    }

    /// Adds the unsent counts since the last call to the metrics' (each thread that
    /// writes packets adds its own).
    fn publish(&mut self, shared: &Shared) {
        for ((n, before), total) in self
            .unsent
            .iter()
            .zip(&mut self.published)
            .zip(&shared.unsent)
        {
            total.fetch_add(n - *before, Ordering::Relaxed);
            *before = *n;
        }
    }
}

/// The most batches that can be out of the I/O thread's hands at once: a full channel to
/// each worker, one in each worker's hands and a full channel back, plus one being filled
/// per worker. The I/O thread makes buffers for no more than this; past it, it waits for
/// processed batches and reuses theirs (buffers made anew are zeroed, 9 KB each).
fn batches_in_flight(workers: usize) -> usize {
    workers * (2 * QUEUE + 2) + 1
}

/// What a worker receives from and sends to the other stages.
struct WorkerChannels {
    /// Batches from the I/O thread.
    rx: Receiver<Vec<PacketBuf>>,
    /// Processed batches back to the I/O thread.
    done: Sender<Processed>,
    /// Mirror-copy buffers the I/O thread has written, back for reuse.
    spares: Receiver<Vec<PacketBuf>>,
    /// Flow records to the IPFIX exporter, when exporting.
    flows: Option<Sender<Vec<FlowRecord>>>,
    /// The worker's place among the channels of the I/O thread that feeds it.
    index: usize,
}

fn worker(id: usize, shared: &Shared, ch: WorkerChannels) {
    let mut w = Worker::new(id, shared, ch);
    loop {
        // Between batches no longer than it takes to publish: counts then never lag a
        // scrape by more than that, traffic or not.
        match w.ch.rx.recv_timeout(PUBLISH_EVERY) {
            Ok(batch) => {
                if !w.process(batch) {
                    break;
                }
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => w.idle(),
        }
    }
    w.finish();
}

/// A worker's engine and what it keeps between batches. A worker thread runs one; with
/// one worker and live ports the I/O thread runs it itself ([`Worker::pump`]), sparing
/// two thread wake-ups a batch.
struct Worker<'s> {
    id: usize,
    shared: &'s Shared,
    ch: WorkerChannels,
    engine: Engine,
    /// Buffers for mirror copies: they travel to the I/O thread and come back, so after
    /// the first copies none is allocated.
    spare: Vec<PacketBuf>,
    last_export: Instant,
    /// The latest packet time seen (live ports: or the time of day, when idle).
    now_ns: u64,
    /// Flow records the exporter's queue had no room for yet.
    unsent: Option<Vec<FlowRecord>>,
    latency: Latency,
    /// When the counts were last published, and when they are next.
    published: Instant,
    publish_every: Duration,
    batches: u64,
    /// The generation of the pipeline the engine runs.
    generation: u64,
}

impl<'s> Worker<'s> {
    fn new(id: usize, shared: &'s Shared, ch: WorkerChannels) -> Worker<'s> {
        let loaded = shared.loaded();
        let mut engine = Engine::sharing(Arc::clone(&loaded.code));
        engine.share_meters(&loaded.meters, shared.workers);
        if ch.flows.is_some() {
            engine.enable_flows(&loaded.program.telemetry);
        }
        let w = Worker {
            id,
            shared,
            ch,
            engine,
            spare: Vec::new(),
            last_export: Instant::now(),
            now_ns: 0,
            unsent: None,
            latency: Latency::default(),
            published: Instant::now(),
            publish_every: PUBLISH_EVERY,
            batches: 0,
            generation: loaded.generation,
        };
        w.publish(false);
        shared.workers_up.fetch_add(1, Ordering::Relaxed);
        w
    }

    /// Publishes the worker's counts for scrapes; `now_or_later` gives up (false) rather
    /// than wait while a scrape reads them: the next batch tries again.
    fn publish(&self, now_or_later: bool) -> bool {
        let slot = &self.shared.snapshots[self.id];
        let locked = if now_or_later {
            slot.try_lock().ok()
        } else {
            slot.lock().ok()
        };
        let Some(mut s) = locked else {
            return false;
        };
        // Into the vectors of the last publish (counts are published every 100 ms).
        s.stats.clone_from(self.engine.stats());
        s.conntrack = self.engine.conntrack().map(|c| c.stats);
        s.flows = self.engine.flow_stats();
        s.export = None;
        s.latency = self.latency.clone();
        s.generation = self.generation;
        true
    }

    /// Takes the pipeline a reload published, if there is a new one, and says so in the
    /// counts it publishes (the control thread waits for that before another reload).
    fn follow_reload(&mut self) {
        if self.shared.generation.load(Ordering::Acquire) == self.generation {
            return;
        }
        let started = Instant::now();
        let loaded = self.shared.loaded();
        debug_assert_eq!(loaded.generation, self.generation + 1);
        self.engine
            .reload(Arc::clone(&loaded.code), &loaded.renumbering);
        self.engine
            .share_meters(&loaded.meters, self.shared.workers);
        self.generation = loaded.generation;
        self.publish(false);
        self.published = Instant::now();
        let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        (self.shared.reloads.longest_swap_ns).fetch_max(took, Ordering::Relaxed);
    }

    /// Runs a batch and sends it back processed; `false` when the I/O thread is gone.
    fn process(&mut self, mut batch: Vec<PacketBuf>) -> bool {
        self.shared.beats.beat(self.id);
        self.follow_reload();
        self.batches += 1;
        let timed = (self.batches % LATENCY_SAMPLE == 0).then(Instant::now);
        self.engine.process(&mut batch, &mut NoObserver);
        self.now_ns = batch
            .iter()
            .map(|p| p.ts_ns)
            .max()
            .unwrap_or(self.now_ns)
            .max(self.now_ns);
        if let Some(t) = timed {
            self.latency.observe(
                t.elapsed().as_secs_f64() / batch.len() as f64,
                batch.len() as u64,
            );
        }
        let mut mirrors = Vec::new();
        let copies = self.engine.mirrors();
        if !copies.is_empty() {
            while let Ok(mut back) = self.ch.spares.try_recv() {
                self.spare.append(&mut back);
                if mirrors.capacity() == 0 {
                    mirrors = back;
                }
            }
            for c in copies {
                let mut b = self
                    .spare
                    .pop()
                    .unwrap_or_else(|| PacketBuf::new(DEFAULT_MAX_FRAME));
                if b.load(c.data(), c.port, c.ts_ns) {
                    b.verdict = c.verdict;
                    mirrors.push(b);
                } else {
                    self.spare.push(b);
                }
            }
        }
        let processed = Processed {
            packets: batch,
            mirrors,
            worker: self.ch.index,
        };
        if self.ch.done.send(processed).is_err() {
            return false;
        }
        if self.published.elapsed() >= self.publish_every {
            self.publish_now_or_later();
        }
        self.export();
        true
    }

    /// What a worker does when no batch came for [`PUBLISH_EVERY`].
    fn idle(&mut self) {
        self.shared.beats.beat(self.id);
        self.follow_reload();
        // Live ports' time goes on without packets: what timed out ends. (A capture's
        // time is its packets'.)
        if self.shared.live {
            self.now_ns = self.now_ns.max(live_clock_ns());
            self.engine.advance(self.now_ns);
        }
        self.publish_now_or_later();
        self.export();
    }

    /// Publishes unless a scrape is reading (the next try then does), noting when. A
    /// program of a million table entries has as many counters, a copy of milliseconds:
    /// the next publication then waits [`PUBLISH_SHARE`] times as long as this one took,
    /// and counts lag a scrape by that (a second or two) rather than cost the worker 5 %.
    fn publish_now_or_later(&mut self) {
        let started = Instant::now();
        if self.publish(true) {
            self.published = Instant::now();
            self.publish_every = PUBLISH_EVERY.max(started.elapsed() * PUBLISH_SHARE);
        }
    }

    /// Hands the exporter the flow records due (see [`export_due`]).
    fn export(&mut self) {
        self.unsent = export_due(
            &mut self.engine,
            self.ch.flows.as_ref(),
            self.unsent.take(),
            &mut self.last_export,
        );
    }

    /// Runs the batches waiting for it, from the thread that sent them (the I/O thread,
    /// when it runs the only worker itself); with none, does its idle work if due.
    fn pump(&mut self) {
        // A round of the thread that runs it, whether or not a batch or idle work was
        // due: idle work waits for the next publication, which a large table's counters
        // put off (see `publish_now_or_later`).
        self.shared.beats.beat(self.id);
        let mut ran = false;
        while let Ok(batch) = self.ch.rx.try_recv() {
            ran |= self.process(batch);
        }
        if !ran && self.published.elapsed() >= self.publish_every {
            self.idle();
        }
    }

    /// Ends the worker: its flows' last records go to the exporter, its counts are
    /// published, and the channel back to the I/O thread closes.
    fn finish(mut self) {
        if let Some(tx) = &self.ch.flows {
            let mut rest = self.unsent.take().unwrap_or_default();
            self.engine.flush_flows(self.now_ns, &mut rest);
            if !rest.is_empty() {
                let _ = tx.send(rest);
            }
        }
        self.publish(false);
    }
}

/// Hands the exporter the flow records that are due, when exporting: every
/// [`EXPORT_EVERY`], or once [`RECORDS_EARLY`] wait. A worker never waits for the
/// exporter: while its queue is full, the records not sent (`unsent`, returned) wait here
/// and new ones in the engine, whose buffers are bounded (due flows then stay in the
/// cache; connection records past the bound are counted lost).
fn export_due(
    engine: &mut Engine,
    flows: Option<&Sender<Vec<FlowRecord>>>,
    unsent: Option<Vec<FlowRecord>>,
    last_export: &mut Instant,
) -> Option<Vec<FlowRecord>> {
    let tx = flows?;
    let mut unsent = unsent.and_then(|records| queue(tx, records));
    let waiting = engine.flow_records_waiting();
    let due = waiting >= RECORDS_EARLY || (waiting > 0 && last_export.elapsed() >= EXPORT_EVERY);
    if unsent.is_none() && due {
        let mut records = Vec::with_capacity(waiting);
        engine.take_flow_records(&mut records);
        unsent = queue(tx, records);
        *last_export = Instant::now();
    }
    unsent
}

/// Runs what was just handed to the worker, when the I/O thread runs it itself.
fn pump(inline: &mut Option<Worker>) {
    if let Some(w) = inline {
        w.pump();
    }
}

/// The time of day in nanoseconds since 1970.
fn wall_clock_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Live ports' clock: the time of day when it was first read, advanced by the monotonic
/// clock since. The wall clock is stepped when NTP or PTP sets one that was wrong (a
/// DPU's often is at boot): timeouts counted in it would end every connection at a step
/// forward, and at a step back end each new connection at the next sweep while keeping
/// the old ones as long again (Linux's conntrack counts in jiffies for the same reason).
/// What leaves the service in time of day (flow records, capture outputs) is moved onto
/// the wall clock as it leaves ([`live_clock_to_wall`]).
fn live_clock_ns() -> u64 {
    static START: std::sync::OnceLock<(Instant, u64)> = std::sync::OnceLock::new();
    let (at, wall) = START.get_or_init(|| (Instant::now(), wall_clock_ns()));
    wall + at.elapsed().as_nanos() as u64
}

/// What to add to a time of [`live_clock_ns`] to make it the wall clock's now: zero until
/// the wall clock is stepped (both are slewed alike).
fn live_clock_to_wall() -> i64 {
    let live = live_clock_ns();
    wall_clock_ns() as i64 - live as i64
}

/// Hands `records` to the exporter if its queue has room; gives them back if not (and
/// drops them if the exporter is gone).
fn queue(tx: &Sender<Vec<FlowRecord>>, records: Vec<FlowRecord>) -> Option<Vec<FlowRecord>> {
    match tx.try_send(records) {
        Err(TrySendError::Full(back)) => Some(back),
        Ok(()) | Err(TrySendError::Disconnected(_)) => None,
    }
}

/// Sends flow records as IPFIX messages until every worker is done, counting messages sent
/// and refused in `shared`; returns the records sent. Where the collector moves, the
/// templates go again before the next records.
fn export(collector: &mut Collector, rx: &Receiver<Vec<FlowRecord>>, shared: &Shared) -> u64 {
    let Some(counts) = &shared.export else {
        return 0;
    };
    // Neither changes on a reload.
    let loaded = shared.loaded();
    let t = &loaded.program.telemetry;
    let ports = loaded
        .program
        .ports
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let refresh = t.template_refresh.as_secs().max(1);
    // Each message, in its UDP and IP headers, fits the path MTU (a named collector's
    // may be IPv6 after a move).
    let headers = match collector.address() {
        SocketAddr::V4(_) if !collector.follows() => 20 + 8,
        _ => 40 + 8,
    };
    let largest = usize::from(t.ipfix_mtu).saturating_sub(headers);
    let mut exporter =
        Exporter::new(t.observation_domain, largest, refresh, t.sampling).naming(ports);
    let mut sent = 0u64;
    // Failures since the last warning, and when that was: a collector that is down would
    // otherwise be reported for every message.
    let (mut unreported, mut warning) = (0u64, WarnThrottle::default());
    let mut pacer = Pacer::new(t.ipfix_rate);
    let mut send = |collector: &Collector, msg: &[u8]| {
        let wait = pacer.wait(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
            counts
                .paced_ns
                .fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
        }
        match collector.send(msg) {
            Ok(_) => counts.messages.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                unreported += 1;
                if warning.ready() {
                    tracing::warn!(error = %e, messages = unreported, "IPFIX messages not sent");
                    unreported = 0;
                }
                counts.failed.fetch_add(1, Ordering::Relaxed)
            }
        };
    };
    let now_s = || wall_clock_ns() / 1_000_000_000;
    // What the flow records miss (flows the caches had no room for) goes to the collector
    // too, when it has grown: at most once an active timeout, and at the end.
    let ignored = || {
        shared.snapshots.iter().fold((0, 0), |(p, b), s| {
            let f = s.lock().ok().and_then(|s| s.flows).unwrap_or_default();
            (p + f.full_packets, b + f.full_bytes)
        })
    };
    let (every, mut reported, mut reported_at) = (t.active_timeout, (0, 0), None::<Instant>);
    for mut records in rx.iter() {
        if collector.moved() {
            exporter.resend_templates();
        }
        if shared.live {
            let to_wall = live_clock_to_wall();
            for r in &mut records {
                r.first_ns = r.first_ns.saturating_add_signed(to_wall);
                r.last_ns = r.last_ns.saturating_add_signed(to_wall);
            }
        }
        exporter.messages(&records, now_s(), &mut |m| send(collector, m));
        sent += records.len() as u64;
        let now = ignored();
        if now != reported && reported_at.is_none_or(|at| at.elapsed() >= every) {
            exporter.ignored(now.0, now.1, now_s(), &mut |m| send(collector, m));
            (reported, reported_at) = (now, Some(Instant::now()));
        }
    }
    let now = ignored();
    if now != reported {
        exporter.ignored(now.0, now.1, now_s(), &mut |m| send(collector, m));
    }
    sent
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each reason a port closes counts under its own label.
    #[test]
    fn port_close_reasons_name_their_closing() {
        let name = |c: Closing| metrics::PORT_CLOSE_REASONS[c as usize];
        assert_eq!(name(Closing::InterfaceRemoved), "interface_removed");
        assert_eq!(name(Closing::QueuesChanged), "queues_changed");
    }

    /// Flows between two hosts differing in the client's port alone spread evenly over
    /// any number of workers.
    #[test]
    fn a_thread_that_panics_stops_the_service() {
        let watch = Watch {
            stop: Arc::new(AtomicBool::new(false)),
            failed: Arc::new(AtomicBool::new(false)),
        };
        let fine = watch.spawn("fine", || 7).expect("spawned");
        assert_eq!(fine.join().ok(), Some(7));
        assert!(!watch.stop.load(Ordering::Relaxed));
        assert!(!watch.failed.load(Ordering::Relaxed));

        let doomed = watch
            .spawn("doomed", || panic!("a worker's bug"))
            .expect("spawned");
        assert!(doomed.join().is_err());
        assert!(watch.stop.load(Ordering::Relaxed));
        assert!(watch.failed.load(Ordering::Relaxed));
    }
}
