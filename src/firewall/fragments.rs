//! Where recent datagrams' first fragments said what their later fragments cannot (those
//! carry no L4 header): their ports, for connection tracking, and the worker their flow
//! went to, for the service's dealer. A shallow virtual reassembly (VPP's term): nothing
//! is buffered or put back together; each fragment is judged as it comes, and a fragment
//! that arrives before its datagram's first has nothing to go by.

use crate::engine::parse::Datagram;
use crate::hash::KeyedHash;

/// Slots (a power of two): datagrams whose fragments may be in flight at once.
const SLOTS: usize = 1024;

/// How long a first fragment's word stays (packet time): Linux's reassembly timeout
/// (`ipfrag_time`, 30 s).
const TIMEOUT_NS: u64 = 30_000_000_000;

#[derive(Debug, Clone, Copy, Default)]
struct Slot<V> {
    datagram: Datagram,
    value: V,
    seen_ns: u64,
    used: bool,
}

/// What first fragments said, by datagram. Direct-mapped by a keyed hash (nobody sending
/// can aim datagrams at one slot): a datagram whose slot another takes before its last
/// fragment has passed loses the rest.
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
    fn slot(&self, d: &Datagram) -> usize {
        self.seed.hash(*d) as usize & (SLOTS - 1)
    }

    /// Notes what a datagram's first fragment said, at `now`.
    pub fn note(&mut self, d: Datagram, value: V, now: u64) {
        let i = self.slot(&d);
        self.slots[i] = Slot {
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
        let s = &self.slots[self.slot(d)];
        let within = now
            .checked_sub(s.seen_ns)
            .is_some_and(|age| age <= TIMEOUT_NS);
        (s.used && s.datagram == *d && within).then_some(s.value)
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
}
