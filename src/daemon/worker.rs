//! A worker: runs its engine over the batches it is dealt (or reads its own share of
//! live ports), keeps its flow records and publishes its counts.

use super::export::queue;
use super::{live_clock_ns, Processed, Shared, PUBLISH_EVERY, QUEUE};
use crate::engine::{Engine, NoObserver, PacketBuf, DEFAULT_MAX_FRAME};
use crate::telemetry::flows::FlowRecord;
use crate::telemetry::Latency;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A worker spends at most about one part in this many of its time publishing its counts.
const PUBLISH_SHARE: u32 = 200;
/// One batch in this many is timed for the latency histogram.
const LATENCY_SAMPLE: u64 = 64;
/// Workers hand the flow records made to the exporter every this often…
const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// … or once this many wait (a quarter of what a connection table keeps: connections that
/// end fast would fill it in a second).
const RECORDS_EARLY: usize = crate::firewall::conntrack::RECORDS_KEPT / 4;

/// The most batches that can be out of the I/O thread's hands at once: a full channel to
/// each worker, one in each worker's hands and a full channel back, plus one being filled
/// per worker. The I/O thread makes buffers for no more than this; past it, it waits for
/// processed batches and reuses theirs (buffers made anew are zeroed, 9 KB each).
pub(super) fn batches_in_flight(workers: usize) -> usize {
    workers * (2 * QUEUE + 2) + 1
}

/// What a worker receives from and sends to the other stages.
pub(super) struct WorkerChannels {
    /// Batches from the I/O thread.
    pub(super) rx: Receiver<Vec<PacketBuf>>,
    /// Processed batches back to the I/O thread.
    pub(super) done: Sender<Processed>,
    /// Mirror-copy buffers the I/O thread has written, back for reuse.
    pub(super) spares: Receiver<Vec<PacketBuf>>,
    /// Flow records to the IPFIX exporter, when exporting.
    pub(super) flows: Option<Sender<Vec<FlowRecord>>>,
    /// The worker's place among the channels of the I/O thread that feeds it.
    pub(super) index: usize,
}

pub(super) fn worker(id: usize, shared: &Shared, ch: WorkerChannels) {
    let mut w = Worker::new(id, shared, ch);
    loop {
        // Between batches no longer than it takes to publish: counts then never lag a
        // scrape by more than that, traffic or not.
        match w.next_batch() {
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
pub(super) struct Worker<'s> {
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
    pub(super) fn new(id: usize, shared: &'s Shared, ch: WorkerChannels) -> Worker<'s> {
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

    /// The next batch from the I/O thread, waiting no longer than [`PUBLISH_EVERY`] for
    /// it: asleep, or when busy polling, spinning (the I/O thread then hands it over
    /// without waking this thread).
    fn next_batch(&self) -> Result<Vec<PacketBuf>, RecvTimeoutError> {
        if self.shared.busy_poll.is_none() {
            return self.ch.rx.recv_timeout(PUBLISH_EVERY);
        }
        // From the first look that found nothing: the time spun, counted as idle.
        let mut since = None;
        let idled = |since: Option<Instant>| {
            if let Some(from) = since {
                self.shared.idled(self.id, from, Instant::now());
            }
        };
        loop {
            match self.ch.rx.try_recv() {
                Ok(batch) => {
                    idled(since);
                    return Ok(batch);
                }
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) => {
                    let from = *since.get_or_insert_with(Instant::now);
                    if from.elapsed() >= PUBLISH_EVERY {
                        idled(since);
                        return Err(RecvTimeoutError::Timeout);
                    }
                    std::hint::spin_loop();
                }
            }
        }
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
    pub(super) fn finish(mut self) {
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
pub(super) fn pump(inline: &mut Option<Worker>) {
    if let Some(w) = inline {
        w.pump();
    }
}
