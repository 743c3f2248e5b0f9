//! `dpuflow run`: the long-running service. A reader thread merges the capture inputs in
//! timestamp order and deals packets to worker threads by a symmetric flow hash (both
//! directions of a connection reach the same worker and its connection table); each
//! worker owns an engine; a writer thread writes what the workers forward (and the copies
//! `mirror` actions made) and hands the buffers back to the reader (and the copies' back
//! to their worker). The main thread serves metrics. Batches travel through
//! bounded crossbeam channels, so a slow stage holds the others back instead of buffering
//! without bound, and buffers are reused, never allocated per packet.
//!
//! SIGTERM or SIGINT stops the reader; the batches already read are processed and
//! written, outputs are flushed, and the process exits 0.

use crate::engine::parse::{self, TunnelPorts};
use crate::engine::{Engine, NoObserver, PacketBuf, Verdict, DEFAULT_MAX_FRAME};
use crate::io::pcap::{CaptureError, CaptureWriter};
use crate::ir::{PortId, Program};
use crate::replay::{Bindings, Merged, Merger};
use crate::telemetry::flows::FlowRecord;
use crate::telemetry::http::{self, Handler};
use crate::telemetry::ipfix::Exporter;
use crate::telemetry::metrics::{self, Info};
use crate::telemetry::{Latency, Snapshot};
use crossbeam_channel::{bounded, Receiver, Sender};
use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How to run.
#[derive(Debug, Clone)]
pub struct Options {
    pub bindings: Bindings,
    /// Where to serve `/metrics`; none, no endpoint.
    pub metrics: Option<SocketAddr>,
    /// IPFIX collector; none, no export.
    pub ipfix: Option<SocketAddr>,
    pub workers: usize,
    /// Packets per second to read at most (all inputs together).
    pub rate: Option<u64>,
    /// Read the inputs again and again (timestamps keep increasing).
    pub looping: bool,
    pub batch: usize,
}

/// Why the service could not run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// a capture file could not be opened, read or written
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// the metrics address could not be bound
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// a signal handler could not be installed
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    /// a thread of the service failed
    #[error("{0}")]
    Thread(String),
}

/// Snapshots are published at most this often by each worker.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
/// One batch in this many is timed for the latency histogram.
const LATENCY_SAMPLE: u64 = 64;
/// Batches in flight between two stages.
const QUEUE: usize = 8;
/// Workers hand the flow records made to the exporter every this often…
const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// … or once this many wait (a quarter of what a connection table keeps: connections that
/// end fast would fill it in a second).
const RECORDS_EARLY: usize = crate::firewall::conntrack::RECORDS_KEPT / 4;
/// Largest IPFIX message: fits a 1500-byte path MTU with IPv6 and UDP headers.
const IPFIX_MESSAGE: usize = 1400;
/// Flows a worker's cache holds.
const FLOW_CAPACITY: usize = 1 << 20;

/// A processed batch on its way to the writer: the packets, then the copies `mirror`
/// actions made, in buffers that go back to the worker that filled them.
struct Processed {
    packets: Vec<PacketBuf>,
    mirrors: Vec<PacketBuf>,
    worker: usize,
}

struct Shared {
    program: Program,
    info: Info,
    snapshots: Vec<Mutex<Snapshot>>,
    workers_up: AtomicUsize,
    workers: usize,
}

impl Handler for Shared {
    fn metrics(&self) -> String {
        let mut total = Snapshot::default();
        for s in &self.snapshots {
            if let Ok(s) = s.lock() {
                total.merge(&s);
            }
        }
        metrics::render(&self.program, &total, &self.info)
    }

    fn ready(&self) -> bool {
        self.workers_up.load(Ordering::Relaxed) == self.workers
    }
}

/// Runs until the inputs are exhausted (then, with a metrics endpoint, until signalled) or
/// until SIGTERM/SIGINT.
pub fn run(program: Program, load_seconds: f64, opts: Options) -> Result<(), RunError> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop)).map_err(RunError::Signals)?;
    }
    let workers = opts.workers.max(1);
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
    let shared = Arc::new(Shared {
        info: Info {
            version: crate::VERSION.to_owned(),
            backend: "software",
            load_seconds,
            conntrack_limit,
            flow_limit: opts.ipfix.map(|_| (FLOW_CAPACITY * workers) as u64),
        },
        snapshots: (0..workers)
            .map(|_| Mutex::new(Snapshot::default()))
            .collect(),
        workers_up: AtomicUsize::new(0),
        workers,
        program,
    });
    // Open everything before any thread starts, so a bad file fails the command at once.
    let merger = Merger::open(&opts.bindings.inputs)?;
    let mut writers: Vec<Option<CaptureWriter>> =
        (0..shared.program.ports.len()).map(|_| None).collect();
    for (port, path) in &opts.bindings.outputs {
        writers[port.index()] = Some(CaptureWriter::create(path)?);
    }
    if let Some(addr) = opts.metrics {
        tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
    }
    tracing::info!(pipeline = %shared.program.name, workers, inputs = opts.bindings.inputs.len(), "running");

    let (flows_tx, flows_rx) = bounded::<Vec<FlowRecord>>(QUEUE * workers);
    let exporter = match opts.ipfix {
        Some(collector) => {
            let socket = UdpSocket::bind(if collector.is_ipv4() {
                "0.0.0.0:0"
            } else {
                "[::]:0"
            })
            .and_then(|s| s.connect(collector).map(|()| s))
            .map_err(|source| RunError::Listen {
                addr: collector,
                source,
            })?;
            let refresh = shared.program.telemetry.template_refresh.as_secs().max(1);
            tracing::info!(%collector, "exporting IPFIX");
            Some(
                std::thread::Builder::new()
                    .name("ipfix".into())
                    .spawn(move || export(&socket, &flows_rx, refresh))
                    .map_err(|e| RunError::Thread(e.to_string()))?,
            )
        }
        None => None,
    };
    let flows_tx = opts.ipfix.map(|_| flows_tx);
    let (recycle_tx, recycle_rx) = bounded::<Vec<PacketBuf>>(batches_in_flight(workers));
    let (done_tx, done_rx) = bounded::<Processed>(QUEUE * workers);
    let mut to_workers = Vec::new();
    let mut spares_back = Vec::new();
    let mut handles = Vec::new();
    for w in 0..workers {
        let (tx, rx) = bounded::<Vec<PacketBuf>>(QUEUE);
        to_workers.push(tx);
        let (spare_tx, spare_rx) = bounded::<Vec<PacketBuf>>(QUEUE);
        spares_back.push(spare_tx);
        let (shared, done_tx, flows_tx) = (Arc::clone(&shared), done_tx.clone(), flows_tx.clone());
        let channels = WorkerChannels {
            rx,
            done: done_tx,
            spares: spare_rx,
            flows: flows_tx,
        };
        handles.push(
            std::thread::Builder::new()
                .name(format!("worker-{w}"))
                .spawn(move || worker(w, &shared, &channels))
                .map_err(|e| RunError::Thread(e.to_string()))?,
        );
    }
    drop(done_tx);
    drop(flows_tx);
    let writer = {
        let recycle_tx = recycle_tx.clone();
        std::thread::Builder::new()
            .name("writer".into())
            .spawn(move || write_outputs(writers, &done_rx, &recycle_tx, &spares_back))
            .map_err(|e| RunError::Thread(e.to_string()))?
    };
    drop(recycle_tx);
    let reader = {
        let stop = Arc::clone(&stop);
        let (inputs, batch, rate, looping) = (
            opts.bindings.inputs.clone(),
            opts.batch.max(1),
            opts.rate,
            opts.looping,
        );
        std::thread::Builder::new()
            .name("reader".into())
            .spawn(move || {
                read_inputs(
                    merger,
                    &inputs,
                    looping,
                    rate,
                    batch,
                    &to_workers,
                    &recycle_rx,
                    &stop,
                )
            })
            .map_err(|e| RunError::Thread(e.to_string()))?
    };

    // Serve metrics until signalled; without an endpoint, until the inputs are done.
    match &listener {
        Some(l) => http::serve(l, &stop, &*shared).map_err(|e| RunError::Thread(e.to_string()))?,
        None => {
            while !stop.load(Ordering::Relaxed) && !reader.is_finished() {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    let read = reader
        .join()
        .map_err(|_| RunError::Thread("the reader panicked".into()))??;
    for h in handles {
        h.join()
            .map_err(|_| RunError::Thread("a worker panicked".into()))?;
    }
    let unwritten = writer
        .join()
        .map_err(|_| RunError::Thread("the writer panicked".into()))??;
    if let Some(e) = exporter {
        let sent = e
            .join()
            .map_err(|_| RunError::Thread("the IPFIX exporter panicked".into()))?;
        tracing::info!(records = sent, "IPFIX export done");
    }
    tracing::info!(packets = read, unwritten, "stopped");
    Ok(())
}

/// The worker a packet goes to: a symmetric hash of its flow, so both directions meet.
fn pick(pkt: &PacketBuf, tunnels: &TunnelPorts, workers: usize) -> usize {
    if workers == 1 {
        return 0;
    }
    match parse::parse(pkt.data(), tunnels) {
        Ok(m) => parse::flow_hash(pkt.data(), &m.outer) as usize % workers,
        Err(_) => 0,
    }
}

#[allow(clippy::too_many_arguments)]
fn read_inputs(
    mut merger: Merger,
    inputs: &[(PortId, std::path::PathBuf)],
    looping: bool,
    rate: Option<u64>,
    batch: usize,
    to_workers: &[Sender<Vec<PacketBuf>>],
    recycle: &Receiver<Vec<PacketBuf>>,
    stop: &AtomicBool,
) -> Result<u64, CaptureError> {
    let tunnels = TunnelPorts::default();
    let n = to_workers.len();
    let mut pool: Vec<PacketBuf> = Vec::new();
    let mut current: Vec<Vec<PacketBuf>> = (0..n).map(|_| Vec::with_capacity(batch)).collect();
    let (mut made, limit) = (n, batches_in_flight(n));
    let (mut read, mut offset, mut first, mut last) = (0u64, 0u64, None::<u64>, 0u64);
    let start = Instant::now();
    let mut slot = PacketBuf::new(DEFAULT_MAX_FRAME);
    while !stop.load(Ordering::Relaxed) {
        match merger.next(&mut slot)? {
            None if looping && read > 0 => {
                // Again from the start, later in time by the length of one pass.
                offset += last.saturating_sub(first.unwrap_or(last)) + 1_000_000;
                first = None;
                merger = Merger::open(inputs)?;
                continue;
            }
            None => break,
            Some(Merged::Oversize(..)) => continue,
            Some(Merged::Packet) => {}
        }
        first.get_or_insert(slot.ts_ns);
        last = slot.ts_ns;
        slot.ts_ns += offset;
        read += 1;
        let w = pick(&slot, &tunnels, n);
        let fresh = pool
            .pop()
            .unwrap_or_else(|| PacketBuf::new(DEFAULT_MAX_FRAME));
        current[w].push(std::mem::replace(&mut slot, fresh));
        if current[w].len() == batch {
            let empty = recycled(recycle, &mut pool, batch, &mut made, limit);
            let full = std::mem::replace(&mut current[w], empty);
            if to_workers[w].send(full).is_err() {
                break;
            }
        }
        if let Some(pps) = rate {
            let due = Duration::from_secs_f64(read as f64 / pps as f64);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
    for (w, b) in current.into_iter().enumerate() {
        if !b.is_empty() {
            let _ = to_workers[w].send(b);
        }
    }
    Ok(read)
}

/// The most batches that can be out of the reader's hands at once: one being filled per
/// worker, a full channel to each worker, one in each worker's hands, a full channel to
/// the writer and one in its hands. The reader makes no more than this, and the channel
/// that brings them back holds them all, so none is ever dropped and made again (which,
/// with its buffers zeroed anew, halved the service's rate in some runs).
fn batches_in_flight(workers: usize) -> usize {
    workers * (2 * QUEUE + 2) + 1
}

/// An empty batch, its buffers back into the pool: a returned one if any, else a new one
/// while fewer than `batches_in_flight` exist (`made` counts them), else the next one the
/// writer returns.
fn recycled(
    recycle: &Receiver<Vec<PacketBuf>>,
    pool: &mut Vec<PacketBuf>,
    batch: usize,
    made: &mut usize,
    limit: usize,
) -> Vec<PacketBuf> {
    let back = match recycle.try_recv() {
        Ok(b) => Some(b),
        Err(_) if *made < limit => None,
        Err(_) => recycle.recv().ok(),
    };
    match back {
        Some(mut b) => {
            pool.append(&mut b);
            b
        }
        None => {
            *made += 1;
            Vec::with_capacity(batch)
        }
    }
}

/// What a worker receives from and sends to the other stages.
struct WorkerChannels {
    /// Batches from the reader.
    rx: Receiver<Vec<PacketBuf>>,
    /// Processed batches to the writer.
    done: Sender<Processed>,
    /// Mirror-copy buffers the writer has written, back for reuse.
    spares: Receiver<Vec<PacketBuf>>,
    /// Flow records to the IPFIX exporter, when exporting.
    flows: Option<Sender<Vec<FlowRecord>>>,
}

fn worker(id: usize, shared: &Shared, ch: &WorkerChannels) {
    let (rx, done, flows) = (&ch.rx, &ch.done, ch.flows.as_ref());
    // Buffers for mirror copies: they travel to the writer and come back, so after the
    // first copies none is allocated.
    let mut spare: Vec<PacketBuf> = Vec::new();
    let mut engine = Engine::new(&shared.program);
    let t = &shared.program.telemetry;
    if flows.is_some() {
        engine.enable_flows(FLOW_CAPACITY, t.active_timeout, t.idle_timeout);
    }
    let (mut last_export, mut now_ns) = (Instant::now(), 0u64);
    let mut latency = Latency::default();
    let mut last = Instant::now();
    let publish = |engine: &Engine, latency: &Latency| {
        if let Ok(mut s) = shared.snapshots[id].lock() {
            *s = Snapshot {
                stats: engine.stats().clone(),
                conntrack: engine.conntrack().map(|c| c.stats),
                flows: engine.flow_stats(),
                latency: latency.clone(),
            };
        }
    };
    publish(&engine, &latency);
    shared.workers_up.fetch_add(1, Ordering::Relaxed);
    for (n, mut batch) in rx.iter().enumerate() {
        let timed = (n as u64 % LATENCY_SAMPLE == 0).then(Instant::now);
        engine.process(&mut batch, &mut NoObserver);
        now_ns = batch
            .iter()
            .map(|p| p.ts_ns)
            .max()
            .unwrap_or(now_ns)
            .max(now_ns);
        if let Some(t) = timed {
            latency.observe(
                t.elapsed().as_secs_f64() / batch.len() as f64,
                batch.len() as u64,
            );
        }
        let mut mirrors = Vec::new();
        let copies = engine.mirrors();
        if !copies.is_empty() {
            while let Ok(mut back) = ch.spares.try_recv() {
                spare.append(&mut back);
                if mirrors.capacity() == 0 {
                    mirrors = back;
                }
            }
            for c in copies {
                let mut b = spare
                    .pop()
                    .unwrap_or_else(|| PacketBuf::new(DEFAULT_MAX_FRAME));
                if b.load(c.data(), c.port, c.ts_ns) {
                    b.verdict = c.verdict;
                    mirrors.push(b);
                } else {
                    spare.push(b);
                }
            }
        }
        let processed = Processed {
            packets: batch,
            mirrors,
            worker: id,
        };
        if done.send(processed).is_err() {
            break;
        }
        if last.elapsed() >= PUBLISH_EVERY {
            publish(&engine, &latency);
            last = Instant::now();
        }
        let waiting = engine.flow_records_waiting();
        if let Some(tx) = flows.filter(|_| {
            waiting >= RECORDS_EARLY || (waiting > 0 && last_export.elapsed() >= EXPORT_EVERY)
        }) {
            let mut due = Vec::with_capacity(waiting);
            engine.take_flow_records(&mut due);
            let _ = tx.send(due);
            last_export = Instant::now();
        }
    }
    if let Some(tx) = flows {
        let mut rest = Vec::new();
        engine.flush_flows(now_ns, &mut rest);
        if !rest.is_empty() {
            let _ = tx.send(rest);
        }
    }
    publish(&engine, &latency);
}

/// Sends flow records as IPFIX messages until every worker is done; returns the records sent.
fn export(socket: &UdpSocket, rx: &Receiver<Vec<FlowRecord>>, template_refresh_s: u64) -> u64 {
    let mut exporter = Exporter::new(1, IPFIX_MESSAGE, template_refresh_s);
    let mut sent = 0u64;
    for records in rx.iter() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        for msg in exporter.messages(&records, now) {
            if let Err(e) = socket.send(&msg) {
                tracing::warn!(error = %e, "IPFIX message not sent");
            }
        }
        sent += records.len() as u64;
    }
    sent
}

fn write_outputs(
    mut writers: Vec<Option<CaptureWriter>>,
    done: &Receiver<Processed>,
    recycle: &Sender<Vec<PacketBuf>>,
    spares_back: &[Sender<Vec<PacketBuf>>],
) -> Result<u64, CaptureError> {
    let mut unwritten = 0u64;
    for batch in done.iter() {
        for pkt in batch.packets.iter().chain(&batch.mirrors) {
            if let Verdict::Forward(port) = pkt.verdict {
                match &mut writers[port.index()] {
                    Some(w) => w.write(pkt.ts_ns, pkt.data())?,
                    None => unwritten += 1,
                }
            }
        }
        let _ = recycle.try_send(batch.packets);
        if !batch.mirrors.is_empty() {
            let _ = spares_back[batch.worker].try_send(batch.mirrors);
        }
    }
    for w in writers.into_iter().flatten() {
        w.finish()?;
    }
    Ok(unwritten)
}
