//! Paced sweeps: a table that must be examined for timeouts is examined a slice after each
//! batch, the whole of it once a period of packet time (a second unless the table asks for
//! longer), so no batch pays for a scan of it all. Paced by time rather than by packets, a
//! sweep costs a packet less the faster packets come.

/// The period of a table that asks for none: every slot is examined once per this much
/// packet time.
pub const PERIOD_NS: u64 = 1_000_000_000;

/// Slots one call examines at most, so a jump in packet time stalls no batch long.
pub const MAX_SLOTS: usize = 1024;

/// When a table was last swept, and how often it is swept whole.
#[derive(Debug)]
pub struct Pace {
    /// Packet time of the last call that found slots due; 0 before the first call.
    swept_ns: u64,
    period_ns: u64,
}

impl Default for Pace {
    fn default() -> Pace {
        Pace::every(PERIOD_NS)
    }
}

impl Pace {
    /// A pace that examines every slot once per `period_ns` of packet time (at least 1).
    pub fn every(period_ns: u64) -> Pace {
        Pace {
            swept_ns: 0,
            period_ns: period_ns.max(1),
        }
    }

    /// How many of a table's `slots` are due for examination at `now`, at most `most`
    /// ([`MAX_SLOTS`] between batches; more where no packet waits). The first call only
    /// starts the clock.
    pub fn due(&mut self, now: u64, slots: usize, most: usize) -> usize {
        if now <= self.swept_ns || self.swept_ns == 0 {
            self.swept_ns = now;
            return 0;
        }
        let due = slots as u128 * u128::from(now - self.swept_ns) / u128::from(self.period_ns);
        if due == 0 {
            return 0;
        }
        self.swept_ns = now;
        usize::try_from(due).unwrap_or(usize::MAX).min(most)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_of_packet_time_covers_the_table() {
        let mut p = Pace::default();
        assert_eq!(
            p.due(5_000_000_000, 1000, MAX_SLOTS),
            0,
            "the first call starts the clock"
        );
        assert_eq!(
            p.due(5_010_000_000, 1000, MAX_SLOTS),
            10,
            "a hundredth of a second"
        );
        assert_eq!(
            p.due(5_010_000_100, 1000, MAX_SLOTS),
            0,
            "too soon for a slot: time accumulates"
        );
        assert_eq!(p.due(5_011_000_000, 1000, MAX_SLOTS), 1);
        assert_eq!(
            p.due(9_000_000_000, 1_000_000, MAX_SLOTS),
            MAX_SLOTS,
            "capped"
        );
        assert_eq!(
            p.due(8_000_000_000, 1000, MAX_SLOTS),
            0,
            "time going back sweeps nothing"
        );
    }

    #[test]
    fn a_longer_period_examines_fewer_slots() {
        let mut p = Pace::every(4 * PERIOD_NS);
        p.due(1_000_000_000, 1000, MAX_SLOTS);
        assert_eq!(p.due(2_000_000_000, 1000, MAX_SLOTS), 250);
        assert_eq!(p.due(6_000_000_000, 1000, MAX_SLOTS), 1000);
    }
}
