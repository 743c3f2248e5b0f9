//! Colour-blind three-colour markers: single-rate (RFC 2697) and two-rate (RFC 2698).
//!
//! Time comes from the packets' timestamps, so replays meter the same way every time.
//! Token counts are kept scaled by 10^9 (token-nanoseconds) so refills stay exact in
//! integers.

use crate::ir::{Meter, MeterAlgorithm, MeterRate};

const SCALE: u128 = 1_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Color {
    Green,
    Yellow,
    Red,
}

#[derive(Debug, Clone)]
pub struct MeterState {
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
        if self.last_ns == 0 {
            self.last_ns = now_ns;
        }
        self.refill(now_ns);
        let b = if self.bytes {
            len as u128 * SCALE
        } else {
            SCALE
        };
        match self.pir {
            None => {
                if self.c >= b {
                    self.c -= b;
                    Color::Green
                } else if self.e >= b {
                    self.e -= b;
                    Color::Yellow
                } else {
                    Color::Red
                }
            }
            // RFC 2698 §3, colour-blind: P bucket first.
            Some(_) => {
                if self.e < b {
                    Color::Red
                } else if self.c < b {
                    self.e -= b;
                    Color::Yellow
                } else {
                    self.e -= b;
                    self.c -= b;
                    Color::Green
                }
            }
        }
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
