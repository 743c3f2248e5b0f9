//! Longest-prefix-match tables.
//!
//! Fields of up to 32 bits (IPv4 addresses) are looked up in a multibit trie whose slots
//! hold their answer: a root of 2^16 slots indexed by the field's top 16 bits, then nodes
//! of 256 slots for each further 8 bits. Each prefix is written into every slot it covers
//! at its own depth, and a node made under a slot starts with that slot's answer in all
//! its slots, so every slot holds the longest prefix covering it (the DIR-24-8 idea of
//! DPDK's rte_lpm, with 16-8-8 steps to keep the root at 256 KiB). A lookup is at most
//! three dependent loads, however many prefix lengths the table has; one hash probe per
//! length, longest first, took nine for a /24 among the lengths of an Internet table.
//!
//! Wider fields (IPv6) keep one hash map per prefix length, probed longest first: a trie
//! over 128 bits in 8-bit steps would take kilobytes a route, and a binary search on the
//! lengths was slower on an Internet-shaped table, where most lookups end three lengths
//! from the top (docs/benchmarks.md).

use super::field;
use super::prefetch::prefetch;
use super::table::PacketView;
use crate::ir::{Field, Pattern};
use rustc_hash::FxHashMap;

/// Slots of the root: the field's top `ROOT_BITS` bits index it.
const ROOT_BITS: u32 = 16;
/// Bits each node below the root consumes.
const STEP_BITS: u32 = 8;
const STEP_SLOTS: usize = 1 << STEP_BITS;
/// A slot naming a node (its index in the low bits), not an answer.
const NODE: u32 = 1 << 31;
/// Nodes (1 KiB each) from which a root table is looked up a staged batch at a time, the
/// nodes' lines prefetched: past this the trie outgrows a core's cache.
const BATCH_MIN_NODES: usize = 1024;

/// A longest-prefix-match table over one field.
#[derive(Debug)]
pub struct LpmTable {
    index: Index,
}

/// The index, with the field's reader chosen at build time.
#[derive(Debug)]
enum Index {
    Trie(Trie, field::NarrowReader),
    /// (prefix length, mask, prefix → entry index), longest prefix first.
    Levels(Vec<(u8, u128, FxHashMap<u128, usize>)>, field::Reader),
}

impl LpmTable {
    /// The table of `prefixes` (value, length), entry `i` being the `i`th; of equal
    /// prefixes the last is kept.
    pub fn new(field: Field, prefixes: impl IntoIterator<Item = (u128, u8)>) -> LpmTable {
        let kind = field.kind();
        let bits = u32::from(kind.bits());
        let mut masked: Vec<(u128, u8, usize)> = prefixes
            .into_iter()
            .enumerate()
            .map(|(i, (value, len))| {
                let Pattern::Masked { value, .. } = Pattern::prefix(value, len, kind) else {
                    unreachable!("prefix patterns are masks")
                };
                (value, len.min(kind.bits()), i)
            })
            .collect();
        // Shorter prefixes first (a trie needs them so), and in entry order within a length.
        masked.sort_by_key(|&(_, len, i)| (len, i));
        let narrow = field::narrow_reader(field).filter(|_| bits <= 32);
        let index = if let Some(read) = narrow {
            let mut trie = Trie::new(bits);
            for &(value, len, i) in &masked {
                trie.insert(value as u32, u32::from(len), i);
            }
            Index::Trie(trie, read)
        } else {
            let mut levels: Vec<(u8, u128, FxHashMap<u128, usize>)> = Vec::new();
            for &(value, len, i) in &masked {
                if levels.last().is_none_or(|l| l.0 != len) {
                    let Pattern::Masked { mask, .. } = Pattern::prefix(0, len, kind) else {
                        unreachable!("prefix patterns are masks")
                    };
                    levels.push((len, mask, FxHashMap::default()));
                }
                if let Some((_, _, m)) = levels.last_mut() {
                    m.insert(value, i);
                }
            }
            levels.reverse();
            Index::Levels(levels, field::reader(field))
        };
        LpmTable { index }
    }

    /// Whether looking up a batch at once pays: for tries larger than a core's cache.
    pub fn batches(&self) -> bool {
        matches!(&self.index, Index::Trie(t, _) if t.nodes.len() >= BATCH_MIN_NODES)
    }

    /// [`LpmTable::lookup`] for many packets: each one's root slot read and the node under
    /// it prefetched first, 32 at a time, then the walks finished.
    pub fn lookup_batch(&self, pkts: &[PacketView<'_>], out: &mut [Option<usize>]) {
        const CHUNK: usize = 32;
        let Index::Trie(t, read) = &self.index else {
            for (p, o) in pkts.iter().zip(out) {
                *o = self.lookup(p);
            }
            return;
        };
        let mut values = [None; CHUNK];
        for (pkts, out) in pkts.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
            for (v, p) in values.iter_mut().zip(pkts) {
                *v = read(p.frame, p.meta, p.state).map(|v| v as u32);
                if let Some(v) = *v {
                    t.prefetch(v);
                }
            }
            for (o, v) in out.iter_mut().zip(&values) {
                *o = v.and_then(|v| t.lookup(v));
            }
        }
    }

    /// Inlined always: with a second caller (the batched lookup) the compiler stopped
    /// inlining it into the packet's walk, which cost the VXLAN encap path 22 instructions.
    #[inline(always)]
    pub fn lookup(&self, pkt: &PacketView<'_>) -> Option<usize> {
        match &self.index {
            Index::Trie(t, read) => t.lookup(read(pkt.frame, pkt.meta, pkt.state)? as u32),
            Index::Levels(levels, read) => {
                let v = read(pkt.frame, pkt.meta, pkt.state)?;
                levels
                    .iter()
                    .find_map(|(_, mask, m)| m.get(&(v & mask)).copied())
            }
        }
    }
}

/// The multibit trie of a field of `bits` ≤ 32 bits. A slot holds 0 (no prefix covers it),
/// entry + 1, or [`NODE`] | the index of the node under it.
#[derive(Debug)]
struct Trie {
    /// Shift that aligns a value's top bit with bit 31.
    align: u32,
    root: Box<[u32; 1 << ROOT_BITS]>,
    nodes: Vec<[u32; STEP_SLOTS]>,
}

impl Trie {
    fn new(bits: u32) -> Trie {
        Trie {
            align: 32 - bits,
            root: vec![0; 1 << ROOT_BITS]
                .into_boxed_slice()
                .try_into()
                .expect("root size"),
            nodes: Vec::new(),
        }
    }

    /// `value` with its top bit at bit 31.
    #[inline(always)]
    fn key(&self, value: u32) -> u32 {
        value.checked_shl(self.align).unwrap_or(0)
    }

    /// The root slot of `key`.
    #[inline(always)]
    fn root_slot(key: u32) -> usize {
        (key >> (32 - ROOT_BITS)) as usize
    }

    /// The slot of `key` in a node at `depth` bits (the bits after the first `depth`).
    #[inline(always)]
    fn node_slot(key: u32, depth: u32) -> usize {
        ((key >> (32 - depth - STEP_BITS)) as usize) & (STEP_SLOTS - 1)
    }

    /// Adds a prefix (`value` with its host bits clear) of `len` bits for `entry`. Prefixes
    /// come shortest first: then the slots a prefix covers at its own depth never have a
    /// node under them (a node is made only for a longer prefix).
    fn insert(&mut self, value: u32, len: u32, entry: usize) {
        let key = self.key(value);
        let answer = u32::try_from(entry + 1).expect("fewer than 2^31 entries");
        let at = Trie::root_slot(key);
        if len <= ROOT_BITS {
            self.root[at..at + (1 << (ROOT_BITS - len))].fill(answer);
            return;
        }
        let mut node = self.node_for(self.root[at]);
        self.root[at] = NODE | node as u32;
        let mut depth = ROOT_BITS;
        loop {
            let slot = Trie::node_slot(key, depth);
            if len <= depth + STEP_BITS {
                let n = 1 << (depth + STEP_BITS - len);
                self.nodes[node][slot..slot + n].fill(answer);
                return;
            }
            let under = self.node_for(self.nodes[node][slot]);
            self.nodes[node][slot] = NODE | under as u32;
            node = under;
            depth += STEP_BITS;
        }
    }

    /// The node a slot holding `s` names, or a new one holding `s`'s answer in all its
    /// slots (the caller makes the slot name it).
    fn node_for(&mut self, s: u32) -> usize {
        if s & NODE != 0 {
            return (s & !NODE) as usize;
        }
        self.nodes.push([s; STEP_SLOTS]);
        self.nodes.len() - 1
    }

    /// Starts loading the line of the node under `value`'s root slot, if there is one.
    #[inline]
    fn prefetch(&self, value: u32) {
        let key = self.key(value);
        let s = self.root[Trie::root_slot(key)];
        if s & NODE != 0 {
            if let Some(node) = self.nodes.get((s & !NODE) as usize) {
                prefetch(&node[Trie::node_slot(key, ROOT_BITS)]);
            }
        }
    }

    #[inline(always)]
    fn lookup(&self, value: u32) -> Option<usize> {
        let key = self.key(value);
        let mut s = self.root[Trie::root_slot(key)];
        let mut depth = ROOT_BITS;
        while s & NODE != 0 && depth < 32 {
            s = self.nodes.get((s & !NODE) as usize)?[Trie::node_slot(key, depth)];
            depth += STEP_BITS;
        }
        s.checked_sub(1).map(|e| e as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The longest of `prefixes` (value, length) over `bits` bits that covers `v`, the
    /// last of equal ones: the definition, by scanning.
    fn longest(prefixes: &[(u32, u8)], bits: u32, v: u32) -> Option<usize> {
        let mask = |len: u8| match u32::from(len) {
            0 => 0,
            l if l >= bits => u32::MAX >> (32 - bits),
            l => (u32::MAX >> (32 - bits)) & !((u32::MAX >> (32 - bits)) >> l),
        };
        let mut best: Option<(u8, usize)> = None;
        for (i, &(p, len)) in prefixes.iter().enumerate() {
            let len = len.min(bits as u8);
            if v & mask(len) == p & mask(len) && best.is_none_or(|(l, _)| len >= l) {
                best = Some((len, i));
            }
        }
        best.map(|(_, i)| i)
    }

    fn trie(prefixes: &[(u32, u8)], bits: u32) -> Trie {
        let mut sorted: Vec<(u32, u8, usize)> = prefixes
            .iter()
            .enumerate()
            .map(|(i, &(p, len))| {
                let len = len.min(bits as u8);
                let host = if u32::from(len) >= bits {
                    0
                } else {
                    (u32::MAX >> (32 - bits)) >> len
                };
                (p & !host & (u32::MAX >> (32 - bits)), len, i)
            })
            .collect();
        sorted.sort_by_key(|&(_, len, i)| (len, i));
        let mut t = Trie::new(bits);
        for (p, len, i) in sorted {
            t.insert(p, u32::from(len), i);
        }
        t
    }

    #[test]
    fn nested_prefixes_of_every_depth() {
        let p = [
            (0x0a00_0000, 8),  // 10/8
            (0x0a01_0000, 16), // 10.1/16
            (0x0a01_0200, 24), // 10.1.2/24
            (0x0a01_0280, 25), // 10.1.2.128/25
            (0x0a01_0281, 32), // 10.1.2.129/32
            (0, 0),            // default
            (0x0a01_0000, 16), // 10.1/16 again: the last is kept
        ];
        let t = trie(&p, 32);
        assert_eq!(t.lookup(0x0a01_0281), Some(4));
        assert_eq!(t.lookup(0x0a01_0282), Some(3));
        assert_eq!(t.lookup(0x0a01_0201), Some(2));
        assert_eq!(t.lookup(0x0a01_0301), Some(6));
        assert_eq!(t.lookup(0x0a02_0000), Some(0));
        assert_eq!(t.lookup(0x0b00_0000), Some(5));
        assert_eq!(trie(&p[..5], 32).lookup(0x0b00_0000), None);
    }

    /// A trie large enough to be looked up in batches gives what looking up one by one
    /// gives: routes under 2000 /16s, hit, missed, and more specific ones.
    #[test]
    fn batched_lookups_agree_with_single_ones() {
        use crate::engine::field::PacketState;
        use crate::engine::table::testing;
        use crate::ir::FieldId;
        let route = |i: u128| (0x0a00_0000 + (i << 16) + (i % 7) * 256, 24);
        let mut routes: Vec<(u128, u8)> = (0..2000).map(route).collect();
        routes.extend((0..100).map(|i| (0x0a00_0000 + (i << 16) + 0x80, 28)));
        routes.push((0x0a00_0000, 8));
        let table = LpmTable::new(
            Field {
                id: FieldId::Ipv4Dst,
                inner: false,
            },
            routes,
        );
        assert!(table.batches());
        let frames: Vec<Vec<u8>> = (0..300u128)
            .map(|i| {
                let dst = route(i * 7 % 2100).0 + (i % 3) * 0x40 + i % 2 * 0x100;
                crate::wire::testing::frame(false, 0x0b00_0001, dst, 17, 1, 2, 0, 0)
            })
            .collect();
        let metas = testing::parsed(&frames);
        let state = PacketState::default();
        let views = testing::views(&frames, &metas, &state);
        let mut batched = vec![None; views.len()];
        table.lookup_batch(&views, &mut batched);
        let single: Vec<Option<usize>> = views.iter().map(|v| table.lookup(v)).collect();
        assert_eq!(batched, single);
        assert!(single.contains(&Some(2100)), "the /8 catches misses");
        assert!(single
            .iter()
            .any(|e| matches!(e, Some(e) if (2000..2100).contains(e))));
    }

    proptest! {
        /// Tables over IPv4 (the trie) and IPv6 (one map per length) destinations answer
        /// what a scan for the longest covering prefix answers, for packets as parsed.
        #[test]
        fn tables_find_the_longest_prefix_of_packets(
            v6 in any::<bool>(),
            prefixes in proptest::collection::vec((0u128..8, 0u8..=8), 0..30),
            probes in proptest::collection::vec(0u128..8, 1..20),
        ) {
            use crate::engine::field::PacketState;
            use crate::engine::parse::{self, TunnelPorts};
            use crate::ir::{FieldId, ValueKind};
            let (id, kind) = if v6 {
                (FieldId::Ipv6Dst, ValueKind::Ipv6)
            } else {
                (FieldId::Ipv4Dst, ValueKind::Ipv4)
            };
            // Addresses of a small pool, so prefixes of eighths of the width nest.
            let address = |a: u128| if v6 {
                0x2001_0db8_u128 << 96 | a << 93 | a << 64 | a
            } else {
                0x0a00_0000 | a << 21 | a << 8 | a
            };
            let prefixes: Vec<(u128, u8)> = prefixes
                .into_iter()
                .map(|(a, step)| (address(a), (u16::from(step) * u16::from(kind.bits()) / 8) as u8))
                .collect();
            let table = LpmTable::new(Field { id, inner: false }, prefixes.iter().copied());
            prop_assert_eq!(matches!(table.index, Index::Trie(..)), !v6);
            let state = PacketState::default();
            for a in probes {
                let frame = crate::wire::testing::frame(v6, address(1), address(a), 17, 1, 2, 0, 0);
                let meta = parse::parse(&frame, &TunnelPorts::default()).expect("well-formed frame");
                let view = PacketView { frame: &frame, meta: &meta, state: &state };
                let want = prefixes
                    .iter()
                    .enumerate()
                    .filter(|(_, &(p, len))| Pattern::prefix(p, len, kind).matches(address(a)))
                    .max_by_key(|&(i, &(_, len))| (len, i))
                    .map(|(i, _)| i);
                prop_assert_eq!(table.lookup(&view), want);
            }
        }

        /// The trie answers what a scan for the longest covering prefix answers, for
        /// fields of every width up to 32 bits, prefixes clustered so they nest.
        #[test]
        fn trie_finds_the_longest_prefix(
            bits in 1u32..=32,
            prefixes in proptest::collection::vec((0u32..64, any::<u32>(), 0u8..=33), 0..60),
            probes in proptest::collection::vec((0u32..64, any::<u32>()), 1..60),
        ) {
            let field = u32::MAX >> (32 - bits);
            // The top six bits pick one of 64 clusters; the rest vary freely.
            let spread = |top: u32, low: u32| {
                ((top << 26) | (low >> 6)) >> (32 - bits) & field
            };
            let prefixes: Vec<(u32, u8)> = prefixes
                .into_iter()
                .map(|(top, low, len)| (spread(top, low), len))
                .collect();
            let t = trie(&prefixes, bits);
            for (top, low) in probes {
                let v = spread(top, low);
                prop_assert_eq!(t.lookup(v), longest(&prefixes, bits, v), "value {:#x}", v);
            }
            for &(p, _) in &prefixes {
                prop_assert_eq!(t.lookup(p), longest(&prefixes, bits, p), "prefix {:#x}", p);
            }
        }
    }
}
