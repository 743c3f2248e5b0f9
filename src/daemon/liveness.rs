//! Whether the dataplane's threads go on. Each counts its rounds (a batch, or a wait for
//! one that came to nothing) in a [`Beats`] slot; the control thread reads the counts
//! every poll, and a thread whose count has not moved for [`STALL`] is stalled: stuck in a
//! loop, or blocked on an output that takes nothing. `/healthz` then fails, and under
//! systemd the watchdog goes unfed, so the service is restarted rather than left looking
//! alive while no packet moves.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a running dataplane thread may go without a round. Its idle rounds are a
/// tenth of a second apart, and its longest pause, taking up a reloaded pipeline of a
/// million table entries, is far shorter.
pub const STALL: Duration = Duration::from_secs(5);

/// A thread's count, alone on its cache line (128 bytes: two 64-byte lines are fetched
/// together on x86): counts are written every batch, each by its own core.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Beat(AtomicU64);

/// The dataplane threads' round counts, by slot.
#[derive(Debug)]
pub struct Beats(Box<[Beat]>);

impl Beats {
    pub fn new(slots: usize) -> Beats {
        Beats((0..slots).map(|_| Beat::default()).collect())
    }

    /// Counts a round of the thread of `slot`. Once a batch, not a packet; a plain load
    /// and store, not a locked add: a judged slot has one writer, and a count that moves
    /// is all that is read.
    #[inline]
    pub fn beat(&self, slot: usize) {
        if let Some(b) = self.0.get(slot) {
            b.0.store(
                b.0.load(Ordering::Relaxed).wrapping_add(1),
                Ordering::Relaxed,
            );
        }
    }

    /// The count of each slot.
    pub fn counts(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.iter().map(|b| b.0.load(Ordering::Relaxed))
    }
}

/// The control thread's view of the counts: when each last moved.
#[derive(Debug)]
pub struct Liveness {
    /// Per slot: its count when last read, and when that count was first seen.
    seen: Vec<(u64, Instant)>,
}

impl Liveness {
    pub fn new(slots: usize, now: Instant) -> Liveness {
        Liveness {
            seen: vec![(0, now); slots],
        }
    }

    /// Forgets how long counts have stood: from `now`, each must move again within
    /// [`STALL`]. For when the threads were not judged (starting, or not running).
    pub fn restart(&mut self, now: Instant) {
        for (_, since) in &mut self.seen {
            *since = now;
        }
    }

    /// Notes the counts read at `now`; returns the slots among `judged` whose count has
    /// stood still for [`STALL`] or longer, with for how long.
    pub fn observe(
        &mut self,
        counts: impl IntoIterator<Item = u64>,
        judged: impl Fn(usize) -> bool,
        now: Instant,
    ) -> Vec<(usize, Duration)> {
        let mut stalled = Vec::new();
        for (slot, (count, (last, since))) in counts.into_iter().zip(&mut self.seen).enumerate() {
            if count != *last {
                (*last, *since) = (count, now);
                continue;
            }
            let stood = now.saturating_duration_since(*since);
            if stood >= STALL && judged(slot) {
                stalled.push((slot, stood));
            }
        }
        stalled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_count_that_stands_still_past_the_limit_is_stalled_until_it_moves() {
        let beats = Beats::new(2);
        let t0 = Instant::now();
        let mut l = Liveness::new(2, t0);
        let all = |_| true;
        beats.beat(0);
        assert!(l.observe(beats.counts(), all, t0 + SECOND).is_empty());
        // Slot 1 never beat; slot 0 did, a second in.
        assert_eq!(l.observe(beats.counts(), all, t0 + STALL), [(1, STALL)]);
        beats.beat(1);
        let later = t0 + SECOND + STALL;
        assert_eq!(l.observe(beats.counts(), all, later), [(0, STALL)]);
        beats.beat(0);
        assert!(l.observe(beats.counts(), all, later + SECOND).is_empty());
    }

    #[test]
    fn slots_not_judged_and_time_not_judged_do_not_count() {
        let beats = Beats::new(2);
        let t0 = Instant::now();
        let mut l = Liveness::new(2, t0);
        let later = t0 + 2 * STALL;
        assert_eq!(
            l.observe(beats.counts(), |s| s == 1, later),
            [(1, 2 * STALL)]
        );
        l.restart(later);
        assert!(l
            .observe(beats.counts(), |_| true, later + SECOND)
            .is_empty());
    }

    #[test]
    fn counts_share_no_cache_line() {
        assert!(align_of::<Beat>() >= 128);
        let beats = Beats::new(3);
        beats.beat(2);
        beats.beat(2);
        beats.beat(7);
        assert_eq!(beats.counts().collect::<Vec<_>>(), [0, 0, 2]);
    }
}
