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
//!
//! Here: `run`, which starts the threads and waits for them, and what they share. The
//! threads are in `io_thread.rs`, `worker.rs`, `export.rs` (IPFIX) and `control.rs`
//! (reloads, health, the service manager); how packets are dealt in `steering.rs`, which
//! cores take which thread in `cpus.rs`.

mod announce;
mod control;
pub mod cpus;
mod export;
mod io_thread;
mod liveness;
mod notify;
mod reload;
pub mod steering;
mod worker;

use control::control;
use cpus::{CpuListError, Placement};
use export::export;
use io_thread::{io, readable, Closed, IoEnds, Source, StartingPorts};
use liveness::Beats;
use notify::Notifier;
use reload::Loaded;
pub use reload::{restart_needed, PipelineFile, TelemetryFlags};
use worker::{worker, WorkerChannels};

use crate::engine::{Compiled, DropReason, PacketBuf};
use crate::firewall::conntrack::Conntrack;
use crate::io::af_packet::Fanout;
use crate::io::af_xdp::XdpShares;
use crate::io::live::{LiveError, LivePort, PortShares};
use crate::io::pcap::{CaptureError, CaptureWriter};
use crate::ir::{Driver, PortId, Program, ServiceKind};
use crate::kvcache::server::{KvService, StartError};
use crate::replay::{Bindings, Merger};
use crate::telemetry::basic_auth;
use crate::telemetry::collector::{Collector, Destination};
use crate::telemetry::flows::{FlowCache, FlowRecord};
use crate::telemetry::http::{self, Handler};
use crate::telemetry::metrics::{self, Info, ServiceState, ThreadTimes};
use crate::telemetry::{CollectorStats, ExportStats, Snapshot};
use crossbeam_channel::bounded;
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
    /// IPFIX collectors, each sent every message; none, no export.
    pub ipfix: Vec<Destination>,
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
    /// The threads that read live ports, and the workers they deal to, poll without
    /// sleeping: no wake-up between a frame's arrival and its processing, each thread
    /// keeping its core busy (live ports only).
    pub busy_poll: bool,
}

impl Options {
    /// With [`Options::busy_poll`], the frames an AF_XDP socket's call has the kernel
    /// take at most: a batch.
    fn busy_poll_budget(&self) -> Option<u16> {
        self.busy_poll
            .then(|| u16::try_from(self.batch).unwrap_or(u16::MAX))
    }
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
    /// the metrics endpoint's TLS files cannot be used
    #[error("the metrics endpoint's TLS: {0}")]
    MetricsTls(crate::tls::TlsError),
    /// the metrics endpoint's users' file cannot be used
    #[error("the metrics endpoint's basic_auth_file: {0}")]
    MetricsUsers(basic_auth::UsersError),
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
/// the counters takes long: see [`worker::Worker::publish_now_or_later`]).
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
/// Allocations of this many bytes or more get a mapping of their own, returned to the
/// system when freed (see [`crate::sys::map_large_allocations`]).
const LARGE_ALLOCATION: usize = 256 << 10;
/// Descriptors the service holds besides its KV-cache clients' (listeners, target
/// connections, ports, captures, the metrics endpoint's), rounded up.
const FDS_BESIDE_CLIENTS: u64 = 64;
/// Batches in flight between two stages.
const QUEUE: usize = 8;

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
    /// The dataplane's threads poll without sleeping ([`Options::busy_poll`]), and the
    /// most frames an AF_XDP socket's call takes.
    busy_poll: Option<u16>,
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
    /// Live ports closed and not yet open again (see [`io_thread::Outputs::waiting`]).
    ports_waiting: AtomicUsize,
    /// Per port, its fanout group, when each worker reads and sends its own share of the
    /// live ports.
    groups: Option<Vec<PortShares>>,
    /// The groups are steered by a program of the dealer's choice (the pipeline tracks
    /// connections), which knows the pipeline's tunnel ports.
    steered: bool,
    /// Per port: times its live port was closed to be opened again, by [`io_thread::Closing`].
    port_closes: Vec<[AtomicU64; metrics::PORT_CLOSE_REASONS.len()]>,
    /// Per port: packets forwarded to it that were not sent, as the threads that write
    /// packets last published them (see [`io_thread::Outputs::unsent`]).
    unsent: Vec<AtomicU64>,
    /// The pipeline's KV-cache services.
    kv: Vec<Arc<KvService>>,
    /// The I/O thread has ended (the inputs are done): no worker runs.
    dataplane_done: AtomicBool,
    /// The dataplane threads' rounds: worker `w`'s in slot `w`, the I/O thread's in the
    /// last (see [`liveness`]).
    beats: Beats,
    /// Nanoseconds each dataplane thread spent polling with nothing to do, busy polling
    /// (in [`Shared::beats`]' order: worker `w`'s in slot `w`, the I/O thread's in the
    /// last); a sleeping thread's waits take no CPU time and are not counted.
    idle_ns: Box<[IdleNs]>,
    /// The dataplane threads stalled, if any (see [`control::judge`]).
    stalled: Mutex<Option<Stalled>>,
    /// The service manager, when one asked to be told how the service stands.
    notifier: Option<Notifier>,
    /// TLS on the metrics endpoint, when configured.
    metrics_tls: Option<crate::tls::Rotating>,
    /// The users the metrics endpoint admits to `/metrics`, when configured.
    metrics_users: Option<basic_auth::Users>,
    /// What the metrics endpoint counts of its connections.
    endpoint: http::Counts,
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

/// A dataplane thread's idle nanoseconds, on a line of its own: the threads write theirs
/// as they come back to work, and would otherwise take each other's line away.
#[derive(Debug, Default)]
#[repr(align(128))]
struct IdleNs(AtomicU64);

/// The name of the dataplane thread of slot `slot` among `workers` workers: the workers'
/// slots first, the I/O thread's last.
pub(super) fn thread_name(workers: usize, slot: usize) -> String {
    match slot {
        s if s == workers => "io".to_owned(),
        s => format!("worker-{s}"),
    }
}

/// The slot of the dataplane thread named `name` among `workers` workers, inverse of
/// [`thread_name`].
fn thread_slot(workers: usize, name: &str) -> Option<usize> {
    match name {
        "io" => Some(workers),
        _ => (name.strip_prefix("worker-")?.parse().ok()).filter(|&w| w < workers),
    }
}

impl Shared {
    /// Counts the time from `from` to `to` as spent by thread `slot` polling with nothing
    /// to do. Each slot has one writer, its thread: a plain load and store.
    fn idled(&self, slot: usize, from: Instant, to: Instant) {
        let ns = u64::try_from(to.duration_since(from).as_nanos()).unwrap_or(u64::MAX);
        let idle = &self.idle_ns[slot].0;
        idle.store(
            idle.load(Ordering::Relaxed).saturating_add(ns),
            Ordering::Relaxed,
        );
    }

    /// Reads the TLS files of the metrics endpoint and of the KV-cache services again, and
    /// the metrics endpoint's users (on SIGHUP, whatever becomes of the pipeline's
    /// reload): rotated certificates serve the connections that arrive from now on.
    fn reread_credentials(&self) {
        let reread = [
            (
                "TLS files",
                self.metrics_tls
                    .as_ref()
                    .map(|t| t.reread().map_err(|e| e.to_string())),
            ),
            (
                "users' file",
                self.metrics_users
                    .as_ref()
                    .map(|u| u.reread().map_err(|e| e.to_string())),
            ),
        ];
        for (what, result) in reread {
            match result {
                None => {}
                Some(Ok(())) => tracing::info!("metrics endpoint {what} read again"),
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "metrics endpoint {what} not usable: what was read before stays")
                }
            }
        }
        self.kv.iter().for_each(|kv| kv.reread_tls());
    }

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

    /// Whether every worker has published counts of generation `g`, or none runs any
    /// longer (the inputs are done): a reload then waits for no worker, and what it
    /// changes in the KV-cache services still applies.
    fn workers_run(&self, g: u64) -> bool {
        self.dataplane_done.load(Ordering::Relaxed)
            || (self.snapshots.iter()).all(|s| s.lock().map_or(true, |s| s.generation == g))
    }
}

/// Counted by the exporter thread, read at scrape time.
#[derive(Debug, Default)]
struct ExportCounts {
    /// Each collector's, in the order of [`Options::ipfix`].
    collectors: Vec<CollectorCounts>,
    /// Nanoseconds waited to keep to the rate.
    paced_ns: AtomicU64,
}

/// Counted of one collector.
#[derive(Debug, Default)]
struct CollectorCounts {
    /// As the collector was given.
    label: String,
    /// Messages sent to it.
    messages: AtomicU64,
    /// Messages its socket refused.
    failed: AtomicU64,
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
            collectors: (e.collectors.iter())
                .map(|c| CollectorStats {
                    collector: c.label.clone(),
                    messages: c.messages.load(Ordering::Relaxed),
                    failed: c.failed.load(Ordering::Relaxed),
                })
                .collect(),
            paced_ns: e.paced_ns.load(Ordering::Relaxed),
        });
        // The dataplane's threads (named when spawned): the service's own KV clients'
        // threads come and go, and the main thread only serves scrapes.
        let dataplane = |name: &str| name == "ipfix" || thread_slot(self.workers, name).is_some();
        let state = ServiceState {
            threads: crate::sys::thread_cpu_seconds()
                .into_iter()
                .filter(|(name, _)| dataplane(name))
                .map(|(name, cpu_seconds)| {
                    let idle_ns = thread_slot(self.workers, &name)
                        .map_or(0, |s| self.idle_ns[s].0.load(Ordering::Relaxed));
                    ThreadTimes {
                        name,
                        cpu_seconds,
                        idle_seconds: idle_ns as f64 / 1e9,
                    }
                })
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
            endpoint_refused: self.endpoint.refused.load(Ordering::Relaxed),
            endpoint_tls_failures: self
                .metrics_tls
                .as_ref()
                .map(|_| self.endpoint.tls_failures.load(Ordering::Relaxed)),
            endpoint_auth_failures: self
                .metrics_users
                .as_ref()
                .map(|_| self.endpoint.auth_failures.load(Ordering::Relaxed)),
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

    fn counts(&self) -> &http::Counts {
        &self.endpoint
    }

    fn admits(&self, authorization: Option<&str>) -> bool {
        (self.metrics_users.as_ref()).is_none_or(|users| users.admit(authorization))
    }
}

/// How the dataplane's threads share the work, decided before anything is opened.
struct Arrangement {
    workers: usize,
    /// Whether each worker reads and sends its own share of every live port (else the I/O
    /// thread reads them and deals the packets).
    shares: bool,
    /// The kernel's copy of the dealer, where workers share the ports of a pipeline that
    /// tracks connections.
    steering: Option<steering::KernelSteering>,
    /// With shares, each port's group that the workers' sockets or queues join.
    groups: Option<Vec<PortShares>>,
    /// Why the I/O thread deals the packets of live ports, where it does.
    dealt_because: Option<String>,
}

/// Whether port `i` is bound to a capture, as input or output.
fn bound_to_capture(opts: &Options, i: usize) -> bool {
    let b = &opts.bindings;
    b.inputs
        .iter()
        .chain(&b.outputs)
        .any(|(id, _)| usize::from(id.0) == i)
}

/// Says that the dataplane's threads poll without sleeping (`--busy-poll`): a warning
/// when they outnumber the CPUs they may run on (one holds a core while it has nothing to
/// do, and the others wait their turn), and, for each AF_XDP port's interface that does
/// not defer its interrupts, how to have it do so.
fn say_busy_polling(opts: &Options, live: &[Option<LivePort>], workers: usize, shares: bool) {
    let threads = match (shares, workers) {
        (true, n) => n,
        // With one worker the I/O thread runs it.
        (false, 1) => 1,
        (false, n) => n + 1,
    };
    let cpus = match &opts.cpus {
        Some(list) => list.len(),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // With --cpus the other threads have CPUs of their own; without, they and the
    // kernel's packet work share the dataplane's.
    let crowded = opts.cpus.is_none() && threads >= cpus;
    if threads > cpus {
        tracing::warn!(
            threads,
            cpus,
            "busy polling with more dataplane threads than CPUs: they take turns on the \
             cores, each holding one while it has nothing to do (fewer --workers)"
        );
    } else if crowded {
        tracing::warn!(
            threads,
            cpus,
            "busy polling on every CPU: the kernel's packet work and the service's other \
             threads have none to themselves (fewer --workers, or --cpus)"
        );
    } else {
        tracing::info!(
            threads,
            "busy polling: the dataplane's threads poll without sleeping, each keeping its \
             core busy"
        );
    }
    for port in live.iter().flatten().filter(|p| p.driver() == "AF_XDP") {
        let iface = port.iface();
        if crate::sys::interrupts_deferred(iface) == Some(false) {
            tracing::info!(
                iface,
                "busy polling: the interface does not defer its interrupts, so the kernel \
                 also takes its frames in them; to leave them to the service's calls: echo 2 \
                 > /sys/class/net/{iface}/napi_defer_hard_irqs; echo 200000 > \
                 /sys/class/net/{iface}/gro_flush_timeout"
            );
        }
    }
}

/// How many workers there are and whether they share the live ports or have them dealt,
/// from the options, the ports and their interfaces' receive queues.
fn arrange(program: &Program, opts: &Options, code: &Compiled) -> Result<Arrangement, RunError> {
    // Live: a port of driver af_packet or af_xdp bound to no capture, while no capture is
    // replayed (see `run`).
    let bound = |i: usize| bound_to_capture(opts, i);
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
    if opts.busy_poll && !live_xdp && !has_live(Driver::AfPacket) {
        return Err(RunError::Inputs(
            "--busy-poll polls live ports, and the service has none (it replays captures)".into(),
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
    Ok(Arrangement {
        workers,
        shares,
        steering,
        groups,
        dealt_because,
    })
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
    let bound = |i: usize| bound_to_capture(&opts, i);
    let replays = !opts.bindings.inputs.is_empty();
    let code = Arc::new(Compiled::new(&program));
    let Arrangement {
        workers,
        shares,
        steering,
        groups,
        dealt_because,
    } = arrange(&program, &opts, &code)?;
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
            let busy = opts.busy_poll_budget();
            LivePort::open(PortId(i as u16), iface, port.driver, port.mtu, group, busy)
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
    let max_clients: u64 = (program.services.iter())
        .map(|svc| match &svc.kind {
            ServiceKind::KvCache(c) => c.max_clients,
        })
        .sum();
    if !program.services.is_empty() {
        match fd_limit {
            Ok(n) if n < max_clients + FDS_BESIDE_CLIENTS => {
                tracing::warn!(
                    limit = n,
                    "the open file limit leaves room for about {} KV-cache clients, not {} \
                     (raise LimitNOFILE or ulimit -n)",
                    n.saturating_sub(FDS_BESIDE_CLIENTS),
                    max_clients
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
    let metrics_tls = match &program.telemetry.prometheus_tls {
        Some(files) => Some(crate::tls::Rotating::new(files, false).map_err(RunError::MetricsTls)?),
        None => None,
    };
    let metrics_users = match &program.telemetry.prometheus_users {
        Some(path) => Some(basic_auth::Users::read(path).map_err(RunError::MetricsUsers)?),
        None => None,
    };
    let conntrack_limit = program
        .conntrack
        .as_ref()
        .map(|c| c.capacity * workers as u64);
    enough_memory(&program, !opts.ipfix.is_empty(), workers)?;
    let notifier = Notifier::from_env().and_then(|n| {
        n.map_err(|e| tracing::warn!(error = %e, "the service manager's NOTIFY_SOCKET is unusable"))
            .ok()
    });
    let shared = Arc::new(Shared {
        info: Info {
            version: crate::VERSION.to_owned(),
            backend: "software",
            conntrack_limit,
            flow_limit: (!opts.ipfix.is_empty())
                .then(|| program.telemetry.flow_cache * workers as u64),
        },
        snapshots: (0..workers)
            .map(|_| Mutex::new(Snapshot::default()))
            .collect(),
        export: (!opts.ipfix.is_empty()).then(|| ExportCounts {
            collectors: (opts.ipfix.iter())
                .map(|to| CollectorCounts {
                    label: to.label(),
                    ..CollectorCounts::default()
                })
                .collect(),
            paced_ns: AtomicU64::new(0),
        }),
        live: lives > 0,
        busy_poll: opts.busy_poll_budget(),
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
        idle_ns: (0..=workers).map(|_| IdleNs::default()).collect(),
        stalled: Mutex::new(None),
        notifier,
        metrics_tls,
        metrics_users,
        endpoint: http::Counts::default(),
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
    if opts.busy_poll {
        say_busy_polling(&opts, live, workers, shares);
    }
    tracing::info!(pipeline = %shared.loaded().program.name, workers, inputs = opts.bindings.inputs.len() + lives, "running");

    let (flows_tx, flows_rx) = bounded::<Vec<FlowRecord>>(QUEUE * workers);
    let exporter = if opts.ipfix.is_empty() {
        None
    } else {
        let mut collectors = Vec::new();
        for to in &opts.ipfix {
            collectors.push(Collector::open(to).map_err(|source| RunError::Listen {
                addr: to.address,
                source,
            })?);
            let sampling = shared.loaded().program.telemetry.sampling;
            tracing::info!(collector = %to.address, sampling, "exporting IPFIX");
        }
        let shared = Arc::clone(&shared);
        Some(watch.spawn("ipfix", move || export(&mut collectors, &flows_rx, &shared))?)
    };
    let flows_tx = (!opts.ipfix.is_empty()).then_some(flows_tx);
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
                thread: w,
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
            thread: workers,
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
        Some(l) => http::serve(l, &stop, &*shared, shared.metrics_tls.as_ref())
            .map_err(|e| RunError::Thread(e.to_string()))?,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Slots and names of the dataplane's threads go both ways; other threads have none.
    #[test]
    fn dataplane_threads_are_named_by_slot() {
        for slot in 0..=3 {
            assert_eq!(thread_slot(3, &thread_name(3, slot)), Some(slot));
        }
        assert_eq!(thread_name(3, 3), "io");
        assert_eq!(thread_name(3, 1), "worker-1");
        for other in ["worker-3", "worker-", "ipfix", "control", "worker-x"] {
            assert_eq!(thread_slot(3, other), None, "{other}");
        }
    }

    /// A thread of the service that panics stops it, as failed; one that returns does not.
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
