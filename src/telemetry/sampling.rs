//! Packet selection for sampled flow records: random 1-out-of-N (RFC 5475 §5.2.1,
//! selectorAlgorithm 3 of RFC 5477): the packets are taken in consecutive windows of N and
//! one packet at a random place in each window is selected. Every packet has the same
//! chance, 1/N, and exactly one per window is taken, so the selected count is the
//! packets' count divided by N; unlike taking every N-th packet (systematic count-based
//! selection), it does not alias with traffic whose period shares a factor with N (flows
//! sent round-robin, say, of which every N-th packet would always fall on the same few
//! flows), and a sender cannot tell which of its packets will be counted.

use std::hash::BuildHasher;

#[derive(Debug, Clone)]
pub struct Sampler {
    interval: u32,
    /// Packets to pass over before the next selected one (up to two windows: 64 bits).
    skip: u64,
    /// Packets of the current window after its selected one.
    rest: u32,
    /// splitmix64 state.
    state: u64,
}

impl Sampler {
    /// One packet out of every window of `interval` (at least 1), at places drawn from a
    /// generator seeded with `seed`.
    pub fn new(interval: u32, seed: u64) -> Sampler {
        let mut s = Sampler {
            interval: interval.max(1),
            skip: 0,
            rest: 0,
            state: seed,
        };
        s.skip = u64::from(s.next_window());
        s
    }

    /// [`Sampler::new`] with a seed from the OS's randomness.
    pub fn seeded_randomly(interval: u32) -> Sampler {
        Sampler::new(
            interval,
            std::collections::hash_map::RandomState::new().hash_one(0),
        )
    }

    pub fn interval(&self) -> u32 {
        self.interval
    }

    /// Whether the packet offered now is selected.
    #[inline(always)]
    pub fn selects(&mut self) -> bool {
        if self.skip > 0 {
            self.skip -= 1;
            return false;
        }
        // The rest of this window, then the next one up to its selected place.
        let rest = u64::from(self.rest);
        self.skip = rest + u64::from(self.next_window());
        true
    }

    /// Which of the next `n` packets (at most 32) are selected, as bits (the first packet
    /// bit 0): what offering them one by one to [`Sampler::selects`] gives, for a whole
    /// batch at once.
    #[inline]
    pub fn selects_of(&mut self, n: u32) -> u32 {
        debug_assert!(n <= 32);
        let n = u64::from(n.min(32));
        let (mut picked, mut at) = (0u32, 0u64);
        while self.skip < n - at {
            at += self.skip;
            picked |= 1 << at;
            at += 1;
            self.skip = u64::from(self.rest) + u64::from(self.next_window());
        }
        self.skip -= n - at;
        picked
    }

    /// Draws the selected place in the next window; returns the packets before it, and
    /// notes those after it in `rest`.
    fn next_window(&mut self) -> u32 {
        let at = self.below(self.interval);
        self.rest = self.interval - 1 - at;
        at
    }

    /// A uniform draw from 0..n (splitmix64, reduced by a multiply, with a bias below
    /// n / 2^64).
    fn below(&mut self, n: u32) -> u32 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        ((u128::from(z) * u128::from(n)) >> 64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Exactly one packet in each window of N, at a place that varies.
        #[test]
        fn one_packet_of_each_window(interval in 1u32..50, seed in any::<u64>()) {
            let mut s = Sampler::new(interval, seed);
            let n = interval as usize;
            let picks: Vec<bool> = (0..n * 40).map(|_| s.selects()).collect();
            let places: Vec<usize> = picks
                .chunks(n)
                .map(|w| {
                    assert_eq!(w.iter().filter(|&&p| p).count(), 1, "{w:?}");
                    w.iter().position(|&p| p).unwrap_or(n)
                })
                .collect();
            if interval > 1 {
                prop_assert!(places.iter().any(|&p| p != places[0]), "{:?}", places);
            }
        }
    }

    proptest! {
        /// A batch's selection is the packets' one by one.
        #[test]
        fn a_batch_selects_as_its_packets_would(
            interval in 1u32..80,
            seed in any::<u64>(),
            batches in proptest::collection::vec(0u32..=32, 1..40),
        ) {
            let (mut one, mut batch) = (Sampler::new(interval, seed), Sampler::new(interval, seed));
            for n in batches {
                let picked = (0..n).fold(0u32, |m, i| m | u32::from(one.selects()) << i);
                prop_assert_eq!(batch.selects_of(n), picked);
            }
        }
    }

    /// Round-robin flows whose count shares a factor with N: every N-th packet would see a
    /// quarter of them; random places see them all.
    #[test]
    fn periodic_traffic_is_not_aliased() {
        let (flows, interval) = (64usize, 8u32);
        let mut s = Sampler::new(interval, 7);
        let mut seen = vec![false; flows];
        for p in 0..flows * 200 {
            if s.selects() {
                seen[p % flows] = true;
            }
        }
        assert!(seen.iter().all(|&x| x));
    }

    /// The widest interval: the rest of one window and the start of the next add up past
    /// 32 bits.
    #[test]
    fn widest_interval_spans_two_windows() {
        let mut s = Sampler::new(u32::MAX, 1);
        (s.skip, s.rest) = (0, u32::MAX - 1);
        assert!(s.selects());
        assert!(s.skip >= u64::from(u32::MAX - 1));
    }

    #[test]
    fn interval_one_selects_every_packet() {
        let mut s = Sampler::new(0, 1);
        assert_eq!(s.interval(), 1);
        assert!((0..100).all(|_| s.selects()));
    }
}
