//! `dpuflow bench`: synthetic traffic through the engine on one core, in memory.

use crate::engine::{Engine, NoObserver, PacketBuf, Verdict};
use crate::ir::{PortId, Program};
use crate::traffic::Source;
use std::time::{Duration, Instant};

/// What a benchmark run measured.
#[derive(Debug, Clone)]
pub struct Report {
    pub packets: u64,
    pub elapsed: Duration,
    pub forwarded: u64,
    pub dropped: u64,
    pub queued: u64,
    /// With flow records kept: flows in the cache at the end, and records made.
    pub flows: Option<(u64, u64)>,
    /// Connection tracking's counts at the end, when the pipeline tracks connections.
    pub conntrack: Option<crate::firewall::conntrack::CtStats>,
}

impl Report {
    pub fn mpps(&self) -> f64 {
        self.packets as f64 / self.elapsed.as_secs_f64() / 1e6
    }

    pub fn ns_per_packet(&self) -> f64 {
        self.elapsed.as_nanos() as f64 / self.packets as f64
    }
}

/// Runs `packets` packets from `traffic`, received on `port`, `batch` at a time, after
/// `warmup` untimed packets (which, for instance, fill a connection table). Each packet is
/// copied into its buffer first, as a receive path would. With `telemetry`, the engine
/// keeps the IPFIX flow cache as `dpuflow run --ipfix` does (counters are always kept), so
/// the two can be compared.
pub fn run(
    program: &Program,
    port: PortId,
    traffic: &mut dyn Source,
    warmup: u64,
    packets: u64,
    batch: usize,
    telemetry: bool,
) -> Report {
    let mut engine = Engine::new(program);
    if telemetry {
        engine.enable_flows(&program.telemetry);
    }
    let mut slots: Vec<PacketBuf> = (0..batch.max(1))
        .map(|_| PacketBuf::new(traffic.max_frame()))
        .collect();
    let mut ts = 1_000_000_000u64;
    let mut pump = |count: u64, verdicts: &mut [u64; 3]| {
        let mut done = 0u64;
        while done < count {
            let n = (count - done).min(slots.len() as u64) as usize;
            traffic.load_batch(&mut slots[..n], port, ts, 100);
            ts += 100 * n as u64;
            engine.process(&mut slots[..n], &mut NoObserver);
            for s in &slots[..n] {
                let i = match s.verdict {
                    Verdict::Forward(_) => 0,
                    Verdict::Drop(_) | Verdict::Told(..) => 1,
                    Verdict::Service(_) => 2,
                };
                verdicts[i] += 1;
            }
            done += n as u64;
        }
    };
    pump(warmup, &mut [0; 3]);
    let mut v = [0u64; 3];
    let start = Instant::now();
    pump(packets, &mut v);
    Report {
        packets,
        elapsed: start.elapsed(),
        forwarded: v[0],
        dropped: v[1],
        queued: v[2],
        flows: engine.flow_stats().map(|f| (f.flows, f.records)),
        conntrack: engine.conntrack().map(|c| c.stats),
    }
}

/// What an ACL benchmark measured.
#[derive(Debug, Clone)]
pub struct AclReport {
    pub lookups: u64,
    pub elapsed: Duration,
    /// Rule updates (a delete and an insert count one each) and the time they took.
    pub updates: u64,
    pub update_time: Duration,
    /// Matches found (a checksum of the work, and a guard against it being optimised away).
    pub matched: u64,
}

/// What the second thread of an ACL benchmark does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AclUpdates {
    /// Deletes and re-inserts random rules of the set (the trees hold them: bit flips).
    Churn,
    /// Inserts copies of random rules at priorities after the set's, over the same 4096
    /// ids again and again: rules new to the trees, which wait beside them until a
    /// rebuild folds them in.
    NewRules,
}

/// Classifies `trace` `rounds` times, `batch` keys at a time, on one core. With `updates`,
/// a second thread meanwhile makes that many rule updates of the `kind` given, and the
/// lookups go on until it is done: the rates are those sustained together.
pub fn acl<const N: usize>(
    c: &crate::firewall::acl::Classifier<N>,
    rules: &[crate::firewall::acl::Rule<N>],
    trace: &[crate::firewall::acl::Key<N>],
    batch: usize,
    rounds: u32,
    (updates, kind): (u64, AclUpdates),
) -> AclReport {
    use std::sync::atomic::{AtomicBool, Ordering};
    let batch = batch.max(1);
    let updating = AtomicBool::new(updates > 0);
    std::thread::scope(|s| {
        let updater = (updates > 0).then(|| {
            s.spawn(|| {
                let mut rng = crate::firewall::acl::SplitMix(7);
                let start = Instant::now();
                let mut done = 0u64;
                while done < updates {
                    let id = (rng.next_u64() % rules.len() as u64) as u32;
                    match kind {
                        AclUpdates::Churn => {
                            c.remove(id);
                            c.insert(id, rules[id as usize]);
                            done += 2;
                        }
                        AclUpdates::NewRules => {
                            let at = rules.len() as u64 + done % 4096;
                            c.insert(at as u32, rules[id as usize]);
                            done += 1;
                        }
                    }
                }
                updating.store(false, Ordering::Relaxed);
                (done, start.elapsed())
            })
        });
        let mut out = vec![None; batch];
        let (mut lookups, mut matched, mut round) = (0u64, 0u64, 0u32);
        let start = Instant::now();
        while round < rounds || updating.load(Ordering::Relaxed) {
            for keys in trace.chunks(batch) {
                c.classify_batch(keys, &mut out[..keys.len()]);
                matched += out[..keys.len()].iter().filter(|o| o.is_some()).count() as u64;
                lookups += keys.len() as u64;
            }
            round += 1;
        }
        let elapsed = start.elapsed();
        let (updates, update_time) = updater.map_or((0, Duration::ZERO), |h| {
            h.join().unwrap_or((0, Duration::ZERO))
        });
        AclReport {
            lookups,
            elapsed,
            updates,
            update_time,
            matched,
        }
    })
}
