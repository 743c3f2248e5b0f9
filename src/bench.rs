//! `dpuflow bench`: synthetic traffic through the engine on one core, in memory.

use crate::engine::{Engine, NoObserver, PacketBuf, Verdict};
use crate::ir::{PortId, Program};
use std::time::{Duration, Instant};

/// What a benchmark run measured.
#[derive(Debug, Clone)]
pub struct Report {
    pub packets: u64,
    pub elapsed: Duration,
    pub forwarded: u64,
    pub dropped: u64,
    pub queued: u64,
}

impl Report {
    pub fn mpps(&self) -> f64 {
        self.packets as f64 / self.elapsed.as_secs_f64() / 1e6
    }

    pub fn ns_per_packet(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.packets as f64
    }
}

/// Runs `packets` packets, cycling through `frames`, received on `port`, `batch` at a
/// time. Each packet is copied into its buffer first, as a receive path would.
pub fn run(
    program: &Program,
    port: PortId,
    frames: &[Vec<u8>],
    packets: u64,
    batch: usize,
) -> Report {
    let mut engine = Engine::new(program);
    let max = frames.iter().map(Vec::len).max().unwrap_or(64);
    let mut slots: Vec<PacketBuf> = (0..batch.max(1)).map(|_| PacketBuf::new(max)).collect();
    let (mut forwarded, mut dropped, mut queued) = (0u64, 0u64, 0u64);
    let mut next = 0usize;
    let mut done = 0u64;
    let mut ts = 1_000_000_000u64;
    let start = Instant::now();
    while done < packets {
        let n = (packets - done).min(slots.len() as u64) as usize;
        for slot in &mut slots[..n] {
            slot.load(&frames[next], port, ts);
            next = if next + 1 == frames.len() {
                0
            } else {
                next + 1
            };
            ts += 100;
        }
        engine.process(&mut slots[..n], &mut NoObserver);
        for s in &slots[..n] {
            match s.verdict {
                Verdict::Forward(_) => forwarded += 1,
                Verdict::Drop(_) => dropped += 1,
                Verdict::Service(_) => queued += 1,
            }
        }
        done += n as u64;
    }
    Report {
        packets,
        elapsed: start.elapsed(),
        forwarded,
        dropped,
        queued,
    }
}
