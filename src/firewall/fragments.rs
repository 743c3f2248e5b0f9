//! Where recent datagrams' first fragments said what their later fragments cannot (those
//! carry no L4 header): their ports, for connection tracking, and the worker their flow
//! went to, for the service's dealer. A shallow virtual reassembly (VPP's term): nothing
//! is buffered or put back together; each fragment is judged as it comes, and a fragment
//! that arrives before its datagram's first has nothing to go by.

use crate::engine::parse::Datagram;
use crate::hash::KeyedHash;

/// Datagrams noted at once: buckets of [`WAYS`] slots (a power of two of them).
const SLOTS: usize = 4096;
/// Slots a datagram may take: the oldest of its bucket's gives way.
const WAYS: usize = 4;

/// How long a first fragment's word stays (packet time): Linux's reassembly timeout
/// (`ipfrag_time`, 30 s).
pub const TIMEOUT_NS: u64 = 30_000_000_000;

#[derive(Debug, Clone, Copy, Default)]
struct Slot<V> {
    datagram: Datagram,
    value: V,
    seen_ns: u64,
    used: bool,
}

/// What first fragments said, by datagram. Four-way set-associative by a keyed hash
/// (nobody sending can aim datagrams at one bucket): a new datagram takes the slot of its
/// bucket's oldest, so one loses its later fragments only when four newer datagrams came
/// to its bucket before they passed. (Direct-mapped, any one newer datagram in its slot
/// did: with a thousand in flight, about a third of them lost theirs.)
#[derive(Debug)]
pub struct Fragments<V> {
    slots: Box<[Slot<V>]>,
    seed: KeyedHash,
}

impl<V: Copy + Default> Default for Fragments<V> {
    fn default() -> Fragments<V> {
        Fragments {
            slots: vec![Slot::default(); SLOTS].into_boxed_slice(),
            seed: KeyedHash::new(),
        }
    }
}

impl<V: Copy> Fragments<V> {
    /// The datagram's bucket.
    fn bucket(&self, d: &Datagram) -> std::ops::Range<usize> {
        let first = (self.seed.hash(*d) as usize & (SLOTS / WAYS - 1)) * WAYS;
        first..first + WAYS
    }

    /// Notes what a datagram's first fragment said, at `now`: in its own slot if its
    /// bucket has one (a repeated first fragment), else in the bucket's oldest.
    pub fn note(&mut self, d: Datagram, value: V, now: u64) {
        let range = self.bucket(&d);
        let bucket = &mut self.slots[range];
        let own = bucket.iter().position(|s| s.used && s.datagram == d);
        let oldest = || {
            (0..WAYS)
                .min_by_key(|&i| (bucket[i].used, bucket[i].seen_ns))
                .unwrap_or(0)
        };
        let i = own.unwrap_or_else(oldest);
        bucket[i] = Slot {
            datagram: d,
            value,
            seen_ns: now,
            used: true,
        };
    }

    /// What the datagram's first fragment said, if it came no later than `now` and within
    /// the timeout before it. (A fragment ahead of its first finds nothing, even where the
    /// first was noted before this fragment is judged, as a batch's arrivals are.)
    pub fn first(&self, d: &Datagram, now: u64) -> Option<V> {
        let s = self.slots[self.bucket(d)]
            .iter()
            .find(|s| s.used && s.datagram == *d)?;
        let within = now
            .checked_sub(s.seen_ns)
            .is_some_and(|age| age <= TIMEOUT_NS);
        within.then_some(s.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_fragments_find_their_first_within_the_timeout() {
        let mut f = Fragments::default();
        let d = [1, 2, 3, 4, 17 << 32 | 7];
        assert_eq!(f.first(&d, 5), None, "no first fragment yet");
        f.note(d, (53u16, 4000u16, 17u8), 10);
        assert_eq!(f.first(&d, 11), Some((53, 4000, 17)));
        let other = [1, 2, 3, 4, 17 << 32 | 8];
        assert_eq!(f.first(&other, 11), None, "another datagram");
        assert_eq!(f.first(&d, 10 + TIMEOUT_NS + 1), None, "too late");
        assert_eq!(f.first(&d, 9), None, "ahead of its first");
    }

    /// A thousand datagrams in flight at once find their first fragments: about four are
    /// expected to lose theirs, where five land in one bucket (direct-mapped, about 360
    /// did).
    #[test]
    fn a_thousand_datagrams_in_flight_keep_their_firsts() {
        let mut f = Fragments::default();
        let datagram = |n: u64| [10, 20, 0, 0, 17 << 32 | n];
        for n in 0..1000 {
            f.note(datagram(n), n, n);
        }
        let found = (0..1000)
            .filter(|&n| f.first(&datagram(n), 1000) == Some(n))
            .count();
        assert!(found >= 980, "{found} of 1000");
    }

    /// A bucket's oldest datagram gives way to a new one; the newer stay.
    #[test]
    fn the_oldest_of_a_bucket_gives_way() {
        let mut f = Fragments::default();
        let datagram = |n: u64| [10, 20, 0, 0, 17 << 32 | n];
        // Five datagrams of one bucket, noted in order.
        let target = f.bucket(&datagram(0));
        let same: Vec<u64> = (0..)
            .filter(|&n| f.bucket(&datagram(n)) == target)
            .take(WAYS + 1)
            .collect();
        for (t, &n) in same.iter().enumerate() {
            f.note(datagram(n), n, t as u64);
        }
        assert_eq!(f.first(&datagram(same[0]), 10), None);
        for &n in &same[1..] {
            assert_eq!(f.first(&datagram(n), 10), Some(n));
        }
    }
}
