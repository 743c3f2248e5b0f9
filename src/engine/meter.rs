//! Colour-blind three-colour markers: single-rate (RFC 2697) and two-rate (RFC 2698).
//!
//! Time comes from the packets' timestamps, so replays meter the same way every time.
//! Token counts are kept scaled by 10^9 (token-nanoseconds) so refills stay exact in
//! integers.
//!
//! One engine meters alone. The workers of a service share each meter's buckets
//! ([`SharedMeter`]): a worker marks packets against tokens it took from them in leases,
//! so the meter holds its rate across workers with no lock and no shared write per packet.

use crate::ir::{Meter, MeterAlgorithm, MeterRate};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

const SCALE: u128 = 1_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Color {
    Green,
    Yellow,
    Red,
}

#[derive(Debug, Clone)]
pub struct MeterState {
    /// Where the tokens come from when the meter is shared by workers; `None`: from time.
    lease: Option<Lease>,
    bytes: bool,
    /// Committed rate in units per second (packets, or bytes for bit-rate meters).
    cir: u128,
    /// Second bucket's rate: PIR for RFC 2698; for RFC 2697 the excess bucket fills
    /// from the committed rate's overflow.
    pir: Option<u128>,
    c_cap: u128,
    e_cap: u128,
    c: u128,
    e: u128,
    last_ns: u64,
}

impl MeterState {
    pub fn new(m: &Meter) -> MeterState {
        let bytes = m.unit == MeterRate::Bits;
        let rate = |r: u64| {
            if bytes {
                u128::from(r) / 8
            } else {
                u128::from(r)
            }
        };
        let (pir, e_size) = match m.algorithm {
            MeterAlgorithm::SingleRate { ebs } => (None, ebs),
            MeterAlgorithm::TwoRate { pir, pbs } => (Some(rate(pir)), pbs),
        };
        let c_cap = u128::from(m.cbs) * SCALE;
        let e_cap = u128::from(e_size) * SCALE;
        MeterState {
            lease: None,
            bytes,
            cir: rate(m.cir),
            pir,
            c_cap,
            e_cap,
            c: c_cap,
            e: e_cap,
            last_ns: 0,
        }
    }

    fn refill(&mut self, now_ns: u64) {
        let elapsed = u128::from(now_ns.saturating_sub(self.last_ns));
        self.last_ns = self.last_ns.max(now_ns);
        match self.pir {
            None => {
                // RFC 2697 §3: tokens go to C until full, the overflow to E.
                let add = elapsed * self.cir;
                let to_c = add.min(self.c_cap - self.c);
                self.c += to_c;
                self.e = (self.e + (add - to_c)).min(self.e_cap);
            }
            Some(pir) => {
                self.c = (self.c + elapsed * self.cir).min(self.c_cap);
                self.e = (self.e + elapsed * pir).min(self.e_cap);
            }
        }
    }

    /// Marks a packet of `len` bytes arriving at `now_ns`.
    pub fn mark(&mut self, now_ns: u64, len: usize) -> Color {
        let b = if self.bytes {
            len as u128 * SCALE
        } else {
            SCALE
        };
        if self.lease.is_none() {
            if self.last_ns == 0 {
                self.last_ns = now_ns;
            }
            self.refill(now_ns);
        }
        let MeterState {
            lease, c, e, pir, ..
        } = self;
        // Whether a bucket holds the packet's tokens: a leased one is topped up from the
        // shared buckets first when short.
        let mut holds = |bucket: Bucket, tokens: &mut u128| match lease {
            Some(l) => l.ensure(bucket, tokens, b, now_ns),
            None => *tokens >= b,
        };
        match pir {
            None => {
                if holds(Bucket::C, c) {
                    *c -= b;
                    Color::Green
                } else if holds(Bucket::E, e) {
                    *e -= b;
                    Color::Yellow
                } else {
                    Color::Red
                }
            }
            // RFC 2698 §3, colour-blind: P bucket first.
            Some(_) => {
                if !holds(Bucket::E, e) {
                    Color::Red
                } else if !holds(Bucket::C, c) {
                    *e -= b;
                    Color::Yellow
                } else {
                    *e -= b;
                    *c -= b;
                    Color::Green
                }
            }
        }
    }
}

/// A meter's buckets shared by the workers of a service, refilled by the packets' time
/// (RFC 2697 §3 and RFC 2698 §3, as one engine's meter is). Tokens are token-nanoseconds
/// as there, in 64 bits: a bucket holds at most 18 billion packets or bytes.
#[derive(Debug)]
pub struct SharedMeter {
    c: AtomicU64,
    e: AtomicU64,
    /// The packet time refills have reached; 0 before the first packet.
    last_ns: AtomicU64,
    cir: u128,
    pir: Option<u128>,
    c_cap: u64,
    e_cap: u64,
}

// Token counts publish nothing but themselves, and the refill time only says who adds the
// tokens due: relaxed atomics throughout.
const RELAXED: Ordering = Ordering::Relaxed;

impl SharedMeter {
    /// Adds the tokens due since the last refill, once: the worker that moves the refill
    /// time on adds them; the others, and packets earlier than it, find none due.
    fn refill(&self, now_ns: u64) {
        let last = self.last_ns.load(RELAXED);
        if now_ns <= last
            || self
                .last_ns
                .compare_exchange(last, now_ns, RELAXED, RELAXED)
                .is_err()
        {
            return;
        }
        // The buckets start full, at the first packet's time.
        if last == 0 {
            return;
        }
        let elapsed = u128::from(now_ns - last);
        match self.pir {
            None => {
                let overflow = fill(&self.c, elapsed * self.cir, self.c_cap);
                fill(&self.e, overflow, self.e_cap);
            }
            Some(pir) => {
                fill(&self.c, elapsed * self.cir, self.c_cap);
                fill(&self.e, elapsed * pir, self.e_cap);
            }
        }
    }
}

/// Adds `tokens` to `bucket` up to `cap`: what did not fit.
fn fill(bucket: &AtomicU64, tokens: u128, cap: u64) -> u128 {
    let mut overflow = 0;
    // The closure always answers, so the update always happens.
    let _ = bucket.fetch_update(RELAXED, RELAXED, |t| {
        let sum = u128::from(t) + tokens;
        let kept = sum.min(u128::from(cap));
        overflow = sum - kept;
        Some(kept as u64)
    });
    overflow
}

/// Takes up to `want` tokens from `bucket`: how many it took.
fn take(bucket: &AtomicU64, want: u128) -> u128 {
    let want = u64::try_from(want).unwrap_or(u64::MAX);
    match bucket.fetch_update(RELAXED, RELAXED, |t| (t > 0).then(|| t - t.min(want))) {
        Ok(before) => u128::from(before.min(want)),
        Err(_) => 0,
    }
}

/// One worker's part of a [`SharedMeter`]: its buckets (the [`MeterState`]'s) hold only
/// tokens taken from the shared ones.
#[derive(Debug, Clone)]
struct Lease {
    shared: Arc<SharedMeter>,
    c: Draw,
    e: Draw,
}

/// How a worker draws on one shared bucket.
#[derive(Debug, Clone, Copy)]
struct Draw {
    /// Tokens taken beyond a packet's need, so most packets find theirs at hand: a quarter
    /// of the bucket split over the workers. What the workers hold lets a burst pass that
    /// much beyond the bucket's size.
    extra: u128,
    /// How long the shared bucket takes to earn `extra` (or a small packet's tokens).
    wait_ns: u64,
    /// After the shared bucket fell short, no packet draws again before this time: an
    /// overloaded meter costs its workers no shared write per packet.
    retry_ns: u64,
}

impl Draw {
    fn new(cap: u64, workers: usize, rate: u128, unit: u128) -> Draw {
        let extra = u128::from(cap) / (4 * workers.max(1) as u128);
        let wait = extra.max(unit) / rate.max(1);
        Draw {
            extra,
            wait_ns: u64::try_from(wait).unwrap_or(u64::MAX),
            retry_ns: 0,
        }
    }

    /// Whether `local` holds `need` tokens, topped up from `bucket` of `shared` if not.
    fn ensure(
        &mut self,
        local: &mut u128,
        need: u128,
        now_ns: u64,
        shared: &SharedMeter,
        bucket: &AtomicU64,
    ) -> bool {
        if *local >= need {
            return true;
        }
        if now_ns < self.retry_ns {
            return false;
        }
        shared.refill(now_ns);
        *local += take(bucket, need - *local + self.extra);
        if *local >= need {
            return true;
        }
        self.retry_ns = now_ns.saturating_add(self.wait_ns);
        false
    }
}

/// A meter's two buckets: committed (C) and excess or peak (E, P in RFC 2698).
#[derive(Debug, Clone, Copy)]
enum Bucket {
    C,
    E,
}

impl Lease {
    /// Whether the worker's `bucket`, holding `tokens`, has `need`, topped up from the
    /// shared one when short.
    fn ensure(&mut self, bucket: Bucket, tokens: &mut u128, need: u128, now_ns: u64) -> bool {
        let s = &*self.shared;
        match bucket {
            Bucket::C => self.c.ensure(tokens, need, now_ns, s, &s.c),
            Bucket::E => self.e.ensure(tokens, need, now_ns, s, &s.e),
        }
    }
}

impl MeterState {
    /// Buckets for this meter that the workers of a service share, full.
    pub fn shared(&self) -> SharedMeter {
        let cap = |t: u128| u64::try_from(t).unwrap_or(u64::MAX);
        SharedMeter {
            c: AtomicU64::new(cap(self.c_cap)),
            e: AtomicU64::new(cap(self.e_cap)),
            last_ns: AtomicU64::new(0),
            cir: self.cir,
            pir: self.pir,
            c_cap: cap(self.c_cap),
            e_cap: cap(self.e_cap),
        }
    }

    /// Makes this copy of the meter one of `workers` marking against `shared` (made by
    /// [`MeterState::shared`] from the same meter).
    pub fn lease_from(&mut self, shared: Arc<SharedMeter>, workers: usize) {
        // The smallest packet a draw should wait for: one, or a minimum frame's bytes.
        let unit = if self.bytes { 64 * SCALE } else { SCALE };
        self.lease = Some(Lease {
            c: Draw::new(shared.c_cap, workers, shared.cir, unit),
            e: Draw::new(
                shared.e_cap,
                workers,
                shared.pir.unwrap_or(shared.cir),
                unit,
            ),
            shared,
        });
        (self.c, self.e) = (0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meter(cir: u64, cbs: u64, algorithm: MeterAlgorithm) -> MeterState {
        MeterState::new(&Meter {
            name: "m".into(),
            unit: MeterRate::Packets,
            cir,
            cbs,
            algorithm,
        })
    }

    #[test]
    fn single_rate_burst_then_excess_then_red() {
        let mut m = meter(10, 2, MeterAlgorithm::SingleRate { ebs: 1 });
        let t = 1_000_000_000;
        let colors: Vec<Color> = (0..4).map(|_| m.mark(t, 64)).collect();
        assert_eq!(
            colors,
            [Color::Green, Color::Green, Color::Yellow, Color::Red]
        );
        // 100 ms later one token (10 pps) is back in C.
        assert_eq!(m.mark(t + 100_000_000, 64), Color::Green);
        assert_eq!(m.mark(t + 100_000_000, 64), Color::Red);
    }

    #[test]
    fn two_rate_marks_by_peak_then_committed() {
        let mut m = meter(1, 1, MeterAlgorithm::TwoRate { pir: 2, pbs: 2 });
        let t = 5_000_000_000;
        let colors: Vec<Color> = (0..3).map(|_| m.mark(t, 64)).collect();
        assert_eq!(colors, [Color::Green, Color::Yellow, Color::Red]);
    }

    /// Packets at 10,000 a second for 10 s, dealt in turn to `copies` of a meter of
    /// 100 pps (burst 20; for two-rate, peak 200 pps, burst 20): the packets of each colour.
    fn police(copies: &mut [MeterState]) -> [u64; 3] {
        let mut colors = [0; 3];
        for k in 0..100_000u64 {
            let m = &mut copies[k as usize % copies.len()];
            colors[m.mark(1_000_000_000 + k * 100_000, 64) as usize] += 1;
        }
        colors
    }

    fn shared_by(m: &MeterState, workers: usize) -> Vec<MeterState> {
        let shared = Arc::new(m.shared());
        (0..workers)
            .map(|_| {
                let mut copy = m.clone();
                copy.lease_from(Arc::clone(&shared), workers);
                copy
            })
            .collect()
    }

    /// Shared by four workers, a meter passes what it passes alone: its rate for the time
    /// and its burst, plus at most the quarter of the burst the workers hold between them
    /// (and a packet each). Each worker's own copy passed four times that.
    #[test]
    fn a_shared_meter_holds_its_rate_over_its_workers() {
        for algorithm in [
            MeterAlgorithm::SingleRate { ebs: 0 },
            MeterAlgorithm::TwoRate { pir: 200, pbs: 20 },
        ] {
            let m = meter(100, 20, algorithm.clone());
            let alone = police(&mut [m.clone()]);
            let shared = police(&mut shared_by(&m, 4));
            let apart = police(&mut vec![m.clone(); 4]);
            // The last packet comes 9.9999 s after the first.
            assert_eq!(alone[Color::Green as usize], 999 + 20, "{algorithm:?}");
            for c in [Color::Green, Color::Yellow] {
                let (a, s) = (alone[c as usize], shared[c as usize]);
                assert!(
                    s + 10 >= a && s <= a + 5 + 4,
                    "{algorithm:?} {c:?}: {s} shared, {a} alone"
                );
            }
            assert!(apart[Color::Green as usize] > 3 * alone[Color::Green as usize]);
        }
    }

    /// Workers racing on other threads never pass more than the buckets earned.
    #[test]
    fn workers_on_threads_take_no_token_twice() {
        let m = meter(100, 20, MeterAlgorithm::SingleRate { ebs: 10 });
        let greens: u64 = shared_by(&m, 4)
            .into_iter()
            .map(|mut copy| {
                std::thread::spawn(move || {
                    (0..25_000u64)
                        .filter(|k| copy.mark(1_000_000_000 + k * 400_000, 64) == Color::Green)
                        .count() as u64
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().expect("worker"))
            .sum();
        // 10 s at 100 pps and the burst, plus what four workers may hold ahead.
        assert!((500..=1000 + 20 + 5 + 4).contains(&greens), "{greens}");
    }

    #[test]
    fn bit_rate_meters_count_bytes() {
        let mut m = MeterState::new(&Meter {
            name: "b".into(),
            unit: MeterRate::Bits,
            cir: 8_000,
            cbs: 1500,
            algorithm: MeterAlgorithm::SingleRate { ebs: 0 },
        });
        assert_eq!(m.mark(1, 1000), Color::Green);
        assert_eq!(m.mark(1, 1000), Color::Red);
        // 1000 bytes/s: after one second 1000 bytes are back.
        assert_eq!(m.mark(1_000_000_001, 1000), Color::Green);
    }
}
