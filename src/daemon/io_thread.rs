//! The I/O thread: reads the inputs, deals their packets to the workers, writes what
//! the workers send back.

use super::announce::Announcer;
use super::steering;
use super::worker::{batches_in_flight, pump, Worker, WorkerChannels};
use super::{
    live_clock_ns, live_clock_to_wall, Options, Processed, RunError, Shared, PUBLISH_EVERY,
};
use crate::engine::{parse, Compiled, PacketBuf, DEFAULT_MAX_FRAME};
use crate::firewall::fragments::Fragments;
use crate::io::live::{LivePort, Received, Unsent, Why};
use crate::io::pcap::CaptureWriter;
use crate::ir::PortId;
use crate::replay::{Merged, Merger};
use crate::sys::Readable;
use crate::telemetry::WarnThrottle;
use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
pub(super) struct IoEnds {
    pub(super) to_workers: Vec<Sender<Vec<PacketBuf>>>,
    /// Processed batches from every worker.
    pub(super) done: Receiver<Processed>,
    /// Mirror-copy buffers back to each worker.
    pub(super) spares_back: Vec<Sender<Vec<PacketBuf>>>,
    /// The only worker (its number, and its ends), when the I/O thread runs it itself.
    pub(super) inline: Option<(usize, WorkerChannels)>,
    /// The thread's slot among the dataplane's (see `Shared::beats`): the I/O thread's,
    /// or that of the worker that reads its own share.
    pub(super) thread: usize,
}

/// Where the I/O thread reads packets from.
pub(super) enum Source {
    /// Capture files, merged in timestamp order.
    Captures(Merger),
    /// The live ports (kept in [`Outputs::live`], which sends through them too), and the
    /// wait for any of them to have a frame.
    Live(Readable),
}

/// What the I/O thread read next.
pub(super) enum Read {
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

/// A busy-polling thread's idle time (see `Shared::idle_ns`): from the end of the last
/// round that did work until work comes, counted in then and, while none comes, at each
/// look at the ports (so that scrapes see it grow).
struct Idling<'s> {
    shared: &'s Shared,
    slot: usize,
    since: Option<Instant>,
}

impl Idling<'_> {
    /// A round in which the ports had nothing, begun at `start`, is over: `worked` if it
    /// handed batches over or wrote them (then it was not idle), `look` if the ports were
    /// looked at in it.
    fn round(&mut self, start: Instant, worked: bool, look: bool) {
        if worked {
            self.end(start);
            self.since = Some(Instant::now());
        } else if look {
            self.end(start);
            self.since = Some(start);
        } else {
            self.since.get_or_insert(start);
        }
    }

    /// A frame came: the idling before it, if any, is counted.
    fn work_came(&mut self) {
        if self.since.is_some() {
            self.end(Instant::now());
        }
    }

    fn end(&mut self, at: Instant) {
        if let Some(from) = self.since.take() {
            self.shared.idled(self.slot, from, at);
        }
    }
}

/// How long the I/O thread waits for live ports at a time (it checks for a stop in
/// between).
const IDLE_WAIT: Duration = Duration::from_millis(10);

/// The I/O thread: reads the inputs into batches for the workers until they end (or, with
/// `--loop` or live ports, until `stop`), writing the batches the workers send back as
/// they come; then writes the rest and flushes the outputs. Returns the packets read and
/// those forwarded to a port without an output.
pub(super) fn io(
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
        thread,
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
        announcer: Announcer::new(shared),
    };
    let (n, batch) = (to_workers.len(), opts.batch.max(1));
    let loaded = shared.loaded();
    for (i, port) in out.live.iter_mut().enumerate() {
        if let Some(port) = port {
            out.announcer.opened(port, i);
        }
    }
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
    let busy = shared.busy_poll.is_some();
    let mut idling = Idling {
        shared,
        slot: thread,
        since: None,
    };
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
                let round = (busy.then(Instant::now), sent, out.returned);
                let look = ports_checked.elapsed() >= PUBLISH_EVERY;
                if look {
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
                // Busy polling, what the workers have finished is written and the ports
                // read again at once: nothing waits.
                while out.returned < sent {
                    let processed = match busy {
                        true => done.try_recv().ok(),
                        false => done.recv_timeout(IDLE_WAIT).ok(),
                    };
                    match processed {
                        Some(p) => out.write(p)?,
                        None => break,
                    }
                }
                // What a busy transmit queue left unsent goes before the wait.
                out.flush_live();
                // Busy polling, the ports' pending errors (a link gone down) are still
                // taken, with the ports' other looks.
                let wait = match busy {
                    true => look.then_some(Duration::ZERO),
                    false => Some(IDLE_WAIT),
                };
                if let (Source::Live(readable), Some(wait)) = (&mut source, wait) {
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
                        .wait(wait, said)
                        .map_err(|e| RunError::Thread(e.to_string()))?;
                }
                if let (Some(start), sent_before, returned_before) = round {
                    let worked = (sent_before, returned_before) != (sent, out.returned);
                    idling.round(start, worked, look);
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
        idling.work_came();
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
/// counts; sends the announcements due (see [`Announcer`]); notes how the live ports' clock stands to the wall clock (for capture
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
    out.announcer.reloaded(&mut out.live, shared);
    let mut changed = false;
    for (i, slot) in out.live.iter_mut().enumerate() {
        if let Some(port) = slot {
            out.announcer.due(port, i);
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
            let busy = shared.busy_poll;
            match LivePort::open(PortId(i as u16), iface, spec.driver, spec.mtu, group, busy) {
                Ok(mut port) => {
                    out.announcer.opened(&mut port, i);
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
pub(super) fn readable(live: &[Option<LivePort>]) -> Readable {
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
pub(super) fn send(
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
pub(super) struct StartingPorts {
    /// Capture outputs.
    pub(super) writers: Vec<Option<CaptureWriter>>,
    /// Live ports open.
    pub(super) live: Vec<Option<LivePort>>,
    /// Live ports waiting for their interface.
    pub(super) waiting: Vec<Option<Closed>>,
}

/// Why a live port was closed to be opened again; its value is the index of its name in
/// [`crate::telemetry::metrics::PORT_CLOSE_REASONS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Closing {
    InterfaceRemoved = 0,
    /// An AF_XDP port's interface's receive queues changed.
    QueuesChanged = 1,
}

/// Why a live port is not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Closed {
    /// Its interface did not exist at the start (`--wait-for-interfaces`).
    NotYetOpened,
    /// Its interface was removed, or its receive queues changed.
    Reopening,
}

/// Where processed batches go: their forwarded packets to the output files or live ports,
/// their buffers back to the reading (and the mirror copies' to their worker).
pub(super) struct Outputs {
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
    announcer: Announcer,
}

/// Says why `dropped` frames for `iface` were not sent (or, [`Why::Waiting`], wait).
fn warn_unsent(iface: &str, dropped: usize, why: Why) {
    match why {
        Why::QueueFull => tracing::warn!(iface, dropped, "transmit queue full: frames dropped"),
        Why::LinkDown => tracing::warn!(iface, dropped, "interface down: frames dropped"),
        Why::Refused(e) => {
            tracing::warn!(iface, dropped, error = %e, "send failed: frames dropped")
        }
        Why::Waiting(e) => tracing::warn!(iface, error = %e, "send failed: frames wait"),
    }
}

impl Outputs {
    fn write(&mut self, mut batch: Processed) -> Result<(), RunError> {
        self.returned += 1;
        for pkt in batch.packets.iter().chain(&batch.mirrors) {
            if let Some(port) = pkt.verdict.sent_to() {
                let i = port.index();
                if let Some(w) = &mut self.writers[i] {
                    w.write(pkt.ts_ns.saturating_add_signed(self.to_wall), pkt.data())?;
                } else if let Some(live) = &mut self.live[i] {
                    if let Err(why) = live.send(pkt.data()) {
                        self.unsent[i] += 1;
                        if self.tx_warning.ready() {
                            warn_unsent(live.iface(), 1, why);
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

    /// Hands the live ports what was sent through them (they queue frames until then).
    fn flush_live(&mut self) {
        for (live, unsent) in self.live.iter_mut().zip(&mut self.unsent) {
            let Some(live) = live else { continue };
            let Unsent { dropped, why } = live.flush();
            *unsent += dropped as u64;
            if let Some(why) = why.filter(|_| self.tx_warning.ready()) {
                warn_unsent(live.iface(), dropped, why);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::metrics;

    /// Each reason a port closes counts under its own label.
    #[test]
    fn port_close_reasons_name_their_closing() {
        let name = |c: Closing| metrics::PORT_CLOSE_REASONS[c as usize];
        assert_eq!(name(Closing::InterfaceRemoved), "interface_removed");
        assert_eq!(name(Closing::QueuesChanged), "queues_changed");
    }
}
