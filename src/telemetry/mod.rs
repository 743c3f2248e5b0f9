//! Telemetry: the Prometheus exposition of the engine's counters, and the HTTP endpoint
//! that serves it.
//!
//! Workers count in plain per-worker arrays and publish a copy now and then (never per
//! packet, and never waiting: a copy a scrape is reading is published a batch later); a
//! scrape sums the copies and renders them, so counting costs the packet path nothing.

pub mod basic_auth;
pub mod collector;
pub mod flows;
pub mod http;
pub mod ipfix;
pub mod metrics;
pub mod sampling;

use crate::engine::{Counter, Stats};
use crate::firewall::conntrack::CtStats;
use crate::telemetry::flows::FlowStats;

/// Lets a repeated warning through at most once every ten seconds: a failure that repeats
/// (a collector down, descriptors exhausted, oversize frames) is counted every time and
/// logged now and then, not once per occurrence.
#[derive(Debug, Default)]
pub struct WarnThrottle {
    last: Option<std::time::Instant>,
}

impl WarnThrottle {
    const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// Whether to log now (and, if so, the next not before ten seconds from now).
    pub fn ready(&mut self) -> bool {
        let due = self.last.is_none_or(|t| t.elapsed() >= Self::EVERY);
        if due {
            self.last = Some(std::time::Instant::now());
        }
        due
    }
}

/// Upper bounds of the processing-latency histogram, in seconds.
pub const LATENCY_BUCKETS: [f64; 12] = [
    50e-9, 100e-9, 200e-9, 500e-9, 1e-6, 2e-6, 5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 1e-3,
];

/// A latency histogram with fixed buckets (non-cumulative counts; +Inf is the last slot).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latency {
    pub buckets: [u64; LATENCY_BUCKETS.len() + 1],
    pub sum_seconds: f64,
    pub count: u64,
}

impl Latency {
    /// Records `n` packets that took `seconds` each.
    pub fn observe(&mut self, seconds: f64, n: u64) {
        let i = LATENCY_BUCKETS
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(LATENCY_BUCKETS.len());
        self.buckets[i] += n;
        self.sum_seconds += seconds * n as f64;
        self.count += n;
    }

    pub fn merge(&mut self, o: &Latency) {
        for (a, b) in self.buckets.iter_mut().zip(o.buckets) {
            *a += b;
        }
        self.sum_seconds += o.sum_seconds;
        self.count += o.count;
    }
}

/// What the IPFIX exporter reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportStats {
    /// Each collector's, in the order they were given.
    pub collectors: Vec<CollectorStats>,
    /// Nanoseconds spent waiting to keep to the export's rate.
    pub paced_ns: u64,
}

/// What the IPFIX exporter reports of one collector.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CollectorStats {
    /// The collector as it was given (name or address, and port).
    pub collector: String,
    /// Messages sent to it.
    pub messages: u64,
    /// Messages the socket would not send (the collector unreachable, say): their records
    /// are lost to it.
    pub failed: u64,
}

/// What one worker publishes, and what a scrape sums (with the exporter's counts).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub stats: Stats,
    pub conntrack: Option<CtStats>,
    pub flows: Option<FlowStats>,
    pub export: Option<ExportStats>,
    pub latency: Latency,
    /// The generation of the pipeline whose rules and meters `stats` counts (0 until the
    /// first reload).
    pub generation: u64,
}

fn add_counter(a: &mut Counter, b: &Counter) {
    a.packets += b.packets;
    a.bytes += b.bytes;
}

impl Snapshot {
    /// Adds another worker's counts.
    pub fn merge(&mut self, o: &Snapshot) {
        let s = &mut self.stats;
        if s.ports.is_empty() {
            *s = o.stats.clone();
        } else {
            for (a, b) in s.ports.iter_mut().zip(&o.stats.ports) {
                add_counter(&mut a.rx, &b.rx);
                add_counter(&mut a.tx, &b.tx);
                for (x, y) in a.drops.iter_mut().zip(&b.drops) {
                    *x += y;
                }
                a.congestion_marked += b.congestion_marked;
            }
            for (pa, pb) in s.entries.iter_mut().zip(&o.stats.entries) {
                for (a, b) in pa.iter_mut().zip(pb) {
                    add_counter(a, b);
                }
            }
            for (a, b) in s.meters.iter_mut().zip(&o.stats.meters) {
                for (x, y) in a.iter_mut().zip(b) {
                    *x += y;
                }
            }
            for (a, b) in s.services.iter_mut().zip(&o.stats.services) {
                add_counter(a, b);
            }
        }
        if let Some(b) = &o.conntrack {
            let a = self.conntrack.get_or_insert_with(CtStats::default);
            a.entries += b.entries;
            a.inserts += b.inserts;
            a.expirations += b.expirations;
            a.drops_full += b.drops_full;
            a.early_drops += b.early_drops;
            for (a, b) in a.invalid.iter_mut().zip(b.invalid) {
                *a += b;
            }
        }
        if let Some(b) = &o.flows {
            let a = self.flows.get_or_insert_with(FlowStats::default);
            a.flows += b.flows;
            a.full_packets += b.full_packets;
            a.full_bytes += b.full_bytes;
            a.records += b.records;
            a.lost_records += b.lost_records;
        }
        self.latency.merge(&o.latency);
    }
}
