//! Where recent datagrams' first fragments said their ports were, so that later fragments,
//! which carry no L4 header, meet their connection: a shallow virtual reassembly (VPP's
//! term). Nothing is buffered or put back together; each fragment is judged as it comes.
//! A fragment that arrives before its datagram's first has no ports to go by (it is
//! invalid, as every fragment was without this table).

use crate::hash::KeyedHash;

/// Slots (a power of two): datagrams whose fragments may be in flight at once per worker.
const SLOTS: usize = 1024;

/// How long a first fragment's ports stay (packet time): Linux's reassembly timeout
/// (`ipfrag_time`, 30 s).
const TIMEOUT_NS: u64 = 30_000_000_000;

/// A datagram, as its fragments all say: addresses, identification (RFC 791 §3.2, RFC
/// 8200 §4.5), family and, for IPv4, protocol.
pub type Datagram = [u64; 5];

/// What a datagram's first fragment tells its others: its ports and its upper-layer
/// protocol (an IPv6 fragment after the first names only the header that follows the
/// fragment header, which may be another extension header).
pub type FirstFragment = (u16, u16, u8);

#[derive(Debug, Clone, Copy, Default)]
struct Slot {
    datagram: Datagram,
    first: FirstFragment,
    seen_ns: u64,
    used: bool,
}

/// Direct-mapped by a keyed hash (nobody sending can aim datagrams at one slot): a
/// datagram whose slot another takes before its last fragment has passed loses the rest.
#[derive(Debug)]
pub struct Fragments {
    slots: Box<[Slot]>,
    seed: KeyedHash,
}

impl Default for Fragments {
    fn default() -> Fragments {
        Fragments {
            slots: vec![Slot::default(); SLOTS].into_boxed_slice(),
            seed: KeyedHash::new(),
        }
    }
}

impl Fragments {
    fn slot(&self, d: &Datagram) -> usize {
        self.seed.hash(*d) as usize & (SLOTS - 1)
    }

    /// Notes what a datagram's first fragment carries, at `now`.
    pub fn note(&mut self, d: Datagram, first: FirstFragment, now: u64) {
        let i = self.slot(&d);
        self.slots[i] = Slot {
            datagram: d,
            first,
            seen_ns: now,
            used: true,
        };
    }

    /// What the datagram's first fragment carried, if it came within the timeout.
    pub fn first(&self, d: &Datagram, now: u64) -> Option<FirstFragment> {
        let s = &self.slots[self.slot(d)];
        (s.used && s.datagram == *d && now.saturating_sub(s.seen_ns) <= TIMEOUT_NS)
            .then_some(s.first)
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
        f.note(d, (53, 4000, 17), 10);
        assert_eq!(f.first(&d, 11), Some((53, 4000, 17)));
        let other = [1, 2, 3, 4, 17 << 32 | 8];
        assert_eq!(f.first(&other, 11), None, "another datagram");
        assert_eq!(f.first(&d, 10 + TIMEOUT_NS + 1), None, "too late");
    }
}
