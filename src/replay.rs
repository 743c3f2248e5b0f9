//! Replaying capture files through the software engine: inputs merged in timestamp order,
//! processed in batches, forwarded packets written per output port.
//!
//! Time inside the engine is the packets' capture time, so a replay is deterministic: the
//! same inputs give byte-identical outputs and the same counters.

use crate::engine::{Engine, Observer, PacketBuf, Stats, DEFAULT_MAX_FRAME};
use crate::firewall::conntrack::{CtStats, Invalid};
use crate::io::pcap::{CaptureError, CaptureReader, CaptureWriter};
use crate::ir::{PortId, Program};
use std::path::{Path, PathBuf};

/// Where replayed packets come from and go to.
#[derive(Debug, Clone, Default)]
pub struct Bindings {
    /// Input captures, in command-line order (which breaks timestamp ties).
    pub inputs: Vec<(PortId, PathBuf)>,
    pub outputs: Vec<(PortId, PathBuf)>,
}

impl Bindings {
    /// The pipeline's own capture files for pcap ports not bound otherwise: `file` is read,
    /// `out` is written.
    pub fn with_pipeline_files(mut self, p: &Program) -> Bindings {
        for (i, port) in p.ports.iter().enumerate() {
            let id = PortId(i as u16);
            if let Some(f) = &port.file {
                if !self.inputs.iter().any(|(p, _)| *p == id) {
                    self.inputs.push((id, f.clone()));
                }
            }
            if let Some(f) = &port.out {
                if !self.outputs.iter().any(|(p, _)| *p == id) {
                    self.outputs.push((id, f.clone()));
                }
            }
        }
        self
    }

    /// A file bound where it would lose data: an output that is also an input (it would be
    /// emptied before it is read), the output of two ports (their packets interleaved into
    /// a broken capture), or a second output for one port (only one would be written).
    pub fn conflict(&self, p: &Program) -> Option<String> {
        // Where a path leads, for an output not written yet too (through its directory).
        let resolved = |p: &Path| {
            p.canonicalize()
                .ok()
                .or_else(|| {
                    let dir = match p.parent() {
                        Some(d) if !d.as_os_str().is_empty() => d,
                        _ => Path::new("."),
                    };
                    Some(dir.canonicalize().ok()?.join(p.file_name()?))
                })
                .unwrap_or_else(|| p.to_path_buf())
        };
        let same = |a: &Path, b: &Path| resolved(a) == resolved(b);
        for (i, (port, out)) in self.outputs.iter().enumerate() {
            if self.inputs.iter().any(|(_, input)| same(input, out)) {
                return Some(format!("{} is both an input and an output", out.display()));
            }
            if self.outputs[..i].iter().any(|(_, other)| same(other, out)) {
                return Some(format!("{} is the output of two ports", out.display()));
            }
            if let Some((_, first)) = self.outputs[..i].iter().find(|(other, _)| other == port) {
                return Some(format!(
                    "port `{}` has two outputs, {} and {}",
                    p.ports[port.index()].name,
                    first.display(),
                    out.display()
                ));
            }
        }
        None
    }
}

/// What a replay did.
#[derive(Debug, Clone)]
pub struct Report {
    pub stats: Stats,
    /// Packets read from all inputs.
    pub packets: u64,
    /// Per port: packets forwarded to it that no output file received.
    pub unwritten: Vec<u64>,
    /// Connection tracking's counts, when the pipeline tracks connections.
    pub conntrack: Option<CtStats>,
}

#[derive(Debug)]
struct Input {
    port: PortId,
    reader: CaptureReader,
    /// The input's next packet, read ahead so inputs can be merged by timestamp.
    next: Option<PacketBuf>,
    /// A frame too large for the buffers, counted and skipped.
    oversize: Option<usize>,
}

impl Input {
    /// Reads the next packet into `slot`; `None` at the end of the input.
    fn read(&mut self, slot: &mut PacketBuf) -> Result<Option<Merged>, CaptureError> {
        let port = self.port;
        match self
            .reader
            .next_with(|ts, frame| (slot.load(frame, port, ts), frame.len()))
        {
            None => Ok(None),
            Some(Err(e)) => Err(e),
            Some(Ok((true, _))) => Ok(Some(Merged::Packet)),
            Some(Ok((false, len))) => Ok(Some(Merged::Oversize(port, len))),
        }
    }

    /// Reads the next packet into `buf`, kept as `next` (or marks it oversize); at the end
    /// of the input `next` becomes `None`.
    fn advance(&mut self, mut buf: PacketBuf) -> Result<(), CaptureError> {
        self.next = match self.read(&mut buf)? {
            None => None,
            Some(Merged::Oversize(_, len)) => {
                self.oversize = Some(len);
                Some(buf)
            }
            Some(Merged::Packet) => Some(buf),
        };
        Ok(())
    }
}

/// Capture inputs merged into one stream in timestamp order (ties go to the input named
/// first), read ahead one packet per input; a lone input is read straight into the slot.
#[derive(Debug)]
pub struct Merger {
    inputs: Vec<Input>,
}

/// What [`Merger::next`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Merged {
    /// The packet is in the slot.
    Packet,
    /// A frame too large for the buffers arrived on this port (the slot holds nothing).
    Oversize(PortId, usize),
}

impl Merger {
    pub fn open(inputs: &[(PortId, PathBuf)]) -> Result<Merger, CaptureError> {
        let mut v = Vec::new();
        for (port, path) in inputs {
            let input = Input {
                port: *port,
                reader: CaptureReader::open(path)?,
                next: None,
                oversize: None,
            };
            v.push(input);
        }
        let mut merger = Merger { inputs: v };
        merger.prime()?;
        Ok(merger)
    }

    /// Back to the inputs' first packets, keeping their buffers.
    pub fn rewind(&mut self) -> Result<(), CaptureError> {
        for input in &mut self.inputs {
            input.reader.rewind()?;
            input.next = None;
            input.oversize = None;
        }
        self.prime()
    }

    /// With several inputs, reads each one's first packet, so that they can be merged by
    /// time.
    fn prime(&mut self) -> Result<(), CaptureError> {
        if self.inputs.len() > 1 {
            for input in &mut self.inputs {
                input.advance(PacketBuf::new(DEFAULT_MAX_FRAME))?;
            }
        }
        Ok(())
    }

    /// Puts the next packet into `slot` (swapping buffers, no copy); `None` at the end.
    pub fn next(&mut self, slot: &mut PacketBuf) -> Result<Option<Merged>, CaptureError> {
        // One input, the usual case, has nothing to merge.
        if let [only] = &mut self.inputs[..] {
            return only.read(slot);
        }
        let Some(i) = self
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(i, inp)| inp.next.as_ref().map(|p| (p.ts_ns, i)))
            .min()
            .map(|(_, i)| i)
        else {
            return Ok(None);
        };
        let input = &mut self.inputs[i];
        let pkt = input.next.take().expect("chosen input has a packet");
        let spare = std::mem::replace(slot, pkt);
        let what = match input.oversize.take() {
            Some(len) => Merged::Oversize(input.port, len),
            None => Merged::Packet,
        };
        input.advance(spare)?;
        Ok(Some(what))
    }
}

/// Replays the inputs through `engine`, `batch` packets at a time.
pub fn replay<O: Observer>(
    program: &Program,
    engine: &mut Engine,
    bindings: &Bindings,
    batch: usize,
    obs: &mut O,
) -> Result<Report, CaptureError> {
    let mut merger = Merger::open(&bindings.inputs)?;
    let mut writers: Vec<Option<CaptureWriter>> = (0..program.ports.len()).map(|_| None).collect();
    for (port, path) in &bindings.outputs {
        writers[port.index()] = Some(CaptureWriter::create(path)?);
    }
    let batch = batch.max(1);
    let mut slots: Vec<PacketBuf> = (0..batch)
        .map(|_| PacketBuf::new(DEFAULT_MAX_FRAME))
        .collect();
    let mut unwritten = vec![0u64; program.ports.len()];
    let mut packets = 0u64;
    loop {
        let mut n = 0;
        while n < batch {
            match merger.next(&mut slots[n])? {
                None => break,
                Some(Merged::Packet) => n += 1,
                Some(Merged::Oversize(port, len)) => engine.count_oversize(port, len),
            }
            packets += 1;
        }
        if n == 0 {
            break;
        }
        engine.process(&mut slots[..n], obs);
        for pkt in slots[..n].iter().chain(engine.mirrors()) {
            if let Some(port) = pkt.verdict.sent_to() {
                match &mut writers[port.index()] {
                    Some(w) => w.write(pkt.ts_ns, pkt.data())?,
                    None => unwritten[port.index()] += 1,
                }
            }
        }
    }
    for w in writers.into_iter().flatten() {
        w.finish()?;
    }
    Ok(Report {
        stats: engine.stats().clone(),
        packets,
        unwritten,
        conntrack: engine.conntrack().map(|c| c.stats),
    })
}

impl Report {
    /// A human-readable summary: ports, drops by reason, entries that matched.
    pub fn summary(&self, program: &Program) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(out, "packets read: {}", self.packets);
        let _ = writeln!(
            out,
            "{:<16} {:>12} {:>14} {:>12} {:>14} {:>10}",
            "port", "rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "dropped"
        );
        for (i, port) in program.ports.iter().enumerate() {
            let s = &self.stats.ports[i];
            let dropped: u64 = s.drops.iter().sum();
            let _ = writeln!(
                out,
                "{:<16} {:>12} {:>14} {:>12} {:>14} {:>10}",
                port.name, s.rx.packets, s.rx.bytes, s.tx.packets, s.tx.bytes, dropped
            );
        }
        let mut drops = String::new();
        for (i, port) in program.ports.iter().enumerate() {
            for r in crate::engine::DropReason::ALL {
                let n = self.stats.ports[i].drops[*r as usize];
                if n > 0 {
                    let _ = writeln!(drops, "  {:<16} {:<24} {n}", port.name, r.name());
                }
            }
        }
        if !drops.is_empty() {
            let _ = write!(out, "drops (by input port and reason):\n{drops}");
        }
        for (i, port) in program.ports.iter().enumerate() {
            let n = self.stats.ports[i].congestion_marked;
            if n > 0 {
                let _ = writeln!(
                    out,
                    "{}: {n} marked CE by the fabric, the mark carried inside",
                    port.name
                );
            }
        }
        let _ = writeln!(out, "entries matched:");
        for (pi, pipe) in program.pipes.iter().enumerate() {
            for (name, c) in pipe.entry_names().iter().zip(&self.stats.entries[pi]) {
                if c.packets > 0 {
                    let _ = writeln!(
                        out,
                        "  {:<16} {:<24} {:>10} packets {:>12} bytes",
                        pipe.name, name, c.packets, c.bytes
                    );
                }
            }
        }
        for (si, s) in program.services.iter().enumerate() {
            let c = self.stats.services[si];
            let _ = writeln!(
                out,
                "service {}: {} packets, {} bytes queued",
                s.name, c.packets, c.bytes
            );
        }
        if let Some(ct) = &self.conntrack {
            let _ = writeln!(
                out,
                "conntrack: {} connections, {} created, {} expired, {} dropped early, {} refused (table full)",
                ct.entries, ct.inserts, ct.expirations, ct.early_drops, ct.drops_full
            );
            for r in Invalid::ALL.iter().filter(|r| ct.invalid[**r as usize] > 0) {
                let n = ct.invalid[*r as usize];
                let _ = writeln!(
                    out,
                    "  invalid {:<12} {n:>10} packets: {}",
                    r.name(),
                    r.describe()
                );
            }
        }
        for (i, n) in self.unwritten.iter().enumerate() {
            if *n > 0 {
                let _ = writeln!(
                    out,
                    "note: {n} packets forwarded to port {} were not written (no --out for it)",
                    program.ports[i].name
                );
            }
        }
        out
    }

    /// The same as JSON.
    pub fn to_json(&self, program: &Program) -> serde_json::Value {
        use serde_json::json;
        let ports: Vec<_> = program
            .ports
            .iter()
            .enumerate()
            .map(|(i, port)| {
                let s = &self.stats.ports[i];
                let drops: serde_json::Map<String, serde_json::Value> =
                    crate::engine::DropReason::ALL
                        .iter()
                        .filter(|r| s.drops[**r as usize] > 0)
                        .map(|r| (r.name().to_owned(), json!(s.drops[*r as usize])))
                        .collect();
                json!({
                    "name": port.name,
                    "rx_packets": s.rx.packets, "rx_bytes": s.rx.bytes,
                    "tx_packets": s.tx.packets, "tx_bytes": s.tx.bytes,
                    "drops": drops,
                    "congestion_marked": s.congestion_marked,
                    "unwritten": self.unwritten[i],
                })
            })
            .collect();
        let entries: Vec<_> = program
            .pipes
            .iter()
            .enumerate()
            .flat_map(|(pi, pipe)| {
                pipe.entry_names()
                    .into_iter()
                    .zip(self.stats.entries[pi].clone())
                    .map(move |(name, c)| json!({"pipe": pipe.name, "entry": name, "packets": c.packets, "bytes": c.bytes}))
            })
            .collect();
        let services: Vec<_> = program
            .services
            .iter()
            .enumerate()
            .map(|(i, s)| json!({"name": s.name, "packets": self.stats.services[i].packets, "bytes": self.stats.services[i].bytes}))
            .collect();
        let conntrack = self.conntrack.map(|ct| {
            let invalid: serde_json::Map<String, serde_json::Value> = Invalid::ALL
                .iter()
                .map(|r| (r.name().to_owned(), json!(ct.invalid[*r as usize])))
                .collect();
            json!({
                "entries": ct.entries, "inserts": ct.inserts, "expirations": ct.expirations,
                "early_drops": ct.early_drops, "full_drops": ct.drops_full, "invalid": invalid,
            })
        });
        json!({ "packets": self.packets, "ports": ports, "entries": entries, "services": services, "conntrack": conntrack })
    }
}
