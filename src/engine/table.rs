//! Lookup structures for two of the three pipe bodies: ordered rules and exact-match
//! tables (longest-prefix-match tables are in `lpm`).

use super::field::{self, PacketState};
use super::parse::{l4_fields, Meta, L3};
use super::prefetch::prefetch;
use crate::firewall::acl;
use crate::hash::KeyedHash;
use crate::ir::{Field, FieldId, FieldMatch, Pattern, Rule, ValueKind};
use crate::wire::{be128, be16, be32, ip_proto};
use rustc_hash::FxHashMap;

/// What a classifier sees of one packet.
#[derive(Debug, Clone, Copy)]
pub struct PacketView<'a> {
    pub frame: &'a [u8],
    pub meta: &'a Meta,
    pub state: &'a PacketState,
}

impl PacketView<'_> {
    #[inline]
    pub fn field(&self, f: Field) -> Option<u128> {
        field::read(self.frame, self.meta, self.state, f)
    }

    #[inline]
    fn holds(&self, m: &FieldMatch) -> bool {
        match m.field.id {
            FieldId::GeneveOptClass => field::geneve_options(self.frame, self.meta)
                .any(|(c, _)| m.pattern.matches(c.into())),
            FieldId::GeneveOptType => field::geneve_options(self.frame, self.meta)
                .any(|(_, t)| m.pattern.matches(t.into())),
            _ => self.field(m.field).is_some_and(|v| m.pattern.matches(v)),
        }
    }
}

/// Test frames parsed, and seen as a classifier sees them.
#[cfg(test)]
pub(super) mod testing {
    use super::{Meta, PacketState, PacketView};
    use crate::engine::parse::{self, TunnelPorts};

    pub fn parsed(frames: &[Vec<u8>]) -> Vec<Meta> {
        frames
            .iter()
            .map(|f| parse::parse(f, &TunnelPorts::default()).expect("well-formed frame"))
            .collect()
    }

    pub fn views<'a>(
        frames: &'a [Vec<u8>],
        metas: &'a [Meta],
        state: &'a PacketState,
    ) -> Vec<PacketView<'a>> {
        frames
            .iter()
            .zip(metas)
            .map(|(frame, meta)| PacketView { frame, meta, state })
            .collect()
    }
}

/// Ordered rules, first match wins. The scan below is the reference implementation; a
/// faster classifier can replace it behind this trait.
pub trait RuleClassifier: std::fmt::Debug + Send + Sync {
    /// Index of the first rule that matches, if any.
    fn classify(&self, pkt: &PacketView<'_>) -> Option<usize>;

    /// [`RuleClassifier::classify`] for many packets at once: `out[i]` for `pkts[i]`.
    fn classify_batch(&self, pkts: &[PacketView<'_>], out: &mut [Option<usize>]) {
        for (p, o) in pkts.iter().zip(out) {
            *o = self.classify(p);
        }
    }

    /// Whether [`RuleClassifier::classify_batch`] beats classifying packet by packet
    /// (for a short scan it only adds the gathering of the batch).
    fn batches(&self) -> bool {
        false
    }
}

/// Checks every rule in order.
#[derive(Debug)]
pub struct LinearScan {
    rules: Vec<Box<[Test]>>,
}

/// One match of a rule, with its field's reader chosen at build time (the generic read is
/// a wide `match` on the field).
#[derive(Debug)]
enum Test {
    /// A field of at most 64 bits matched against one interval: its value comes back, and
    /// is tested, in registers.
    Narrow {
        read: field::NarrowReader,
        interval: Interval,
    },
    /// A field of at most 64 bits matched against a set.
    NarrowSet {
        read: field::NarrowReader,
        set: Box<[Interval]>,
    },
    /// An IPv6 address.
    Wide {
        read: field::Reader,
        pattern: Pattern,
    },
    /// A Geneve option field: a list, matched if any option matches.
    GeneveOption(FieldMatch),
}

impl Test {
    fn new(m: &FieldMatch) -> Test {
        match m.field.id {
            FieldId::GeneveOptClass | FieldId::GeneveOptType => Test::GeneveOption(m.clone()),
            _ => match (field::narrow_reader(m.field), &m.pattern) {
                (Some(read), Pattern::Any(ps)) => Test::NarrowSet {
                    read,
                    set: ps.iter().flat_map(Interval::of).collect(),
                },
                (Some(read), p) => match Interval::of(p).as_slice() {
                    [interval] => Test::Narrow {
                        read,
                        interval: *interval,
                    },
                    set => Test::NarrowSet {
                        read,
                        set: set.into(),
                    },
                },
                (None, _) => Test::Wide {
                    read: field::reader(m.field),
                    pattern: m.pattern.clone(),
                },
            },
        }
    }

    #[inline]
    fn holds(&self, pkt: &PacketView<'_>) -> bool {
        match self {
            Test::Narrow { read, interval } => {
                read(pkt.frame, pkt.meta, pkt.state).is_some_and(|v| interval.holds(v))
            }
            Test::NarrowSet { read, set } => {
                read(pkt.frame, pkt.meta, pkt.state).is_some_and(|v| set.iter().any(|i| i.holds(v)))
            }
            Test::Wide { read, pattern } => {
                read(pkt.frame, pkt.meta, pkt.state).is_some_and(|v| pattern.matches(v))
            }
            Test::GeneveOption(m) => pkt.holds(m),
        }
    }
}

/// A masked value or a range over a field of at most 64 bits, in one form: `v` holds when
/// `(v & mask) - lo`, wrapping, is at most `span` (a mask and value: `lo` the value,
/// `span` 0; a range: `mask` all ones). One test, no branch on the kind.
#[derive(Debug, Clone, Copy)]
struct Interval {
    mask: u64,
    lo: u64,
    span: u64,
}

impl Interval {
    /// The values of a narrow field's patterns fit in 64 bits (the checker holds them to
    /// the field's width). An empty range is no interval; a set is its members'.
    fn of(p: &Pattern) -> Vec<Interval> {
        match p {
            Pattern::Masked { value, mask } => vec![Interval {
                mask: *mask as u64,
                lo: *value as u64,
                span: 0,
            }],
            Pattern::Range { lo, hi } if lo <= hi => vec![Interval {
                mask: u64::MAX,
                lo: *lo as u64,
                span: (hi - lo) as u64,
            }],
            Pattern::Range { .. } => Vec::new(),
            Pattern::Any(ps) => ps.iter().flat_map(Interval::of).collect(),
        }
    }

    #[inline(always)]
    fn holds(&self, v: u64) -> bool {
        (v & self.mask).wrapping_sub(self.lo) <= self.span
    }
}

impl LinearScan {
    pub fn new(rules: &[Rule]) -> LinearScan {
        LinearScan {
            rules: rules
                .iter()
                .map(|r| r.matches.iter().map(Test::new).collect())
                .collect(),
        }
    }
}

impl RuleClassifier for LinearScan {
    #[inline(always)]
    fn classify(&self, pkt: &PacketView<'_>) -> Option<usize> {
        self.rules
            .iter()
            .position(|ts| ts.iter().all(|t| t.holds(pkt)))
    }
}

/// Longest keys an exact table takes (the language allows 8 fields).
pub const MAX_EXACT_FIELDS: usize = 8;

/// Exact match on a tuple of fields. Keys whose fields fit in 128 bits together (the
/// common case: addresses and ports) are packed into one integer, so a lookup hashes and
/// compares a single `u128`.
#[derive(Debug)]
pub struct ExactTable {
    /// Each field's reader and width in bits, chosen at build time (the generic read is a
    /// wide `match` on the field).
    readers: Box<[(field::FieldReader, u32)]>,
    map: ExactMap,
}

#[derive(Debug)]
enum ExactMap {
    Packed(PackedMap),
    Wide(FxHashMap<Box<[u128]>, usize>),
}

/// Tables at least this large are looked up for a whole batch at once (their slots miss
/// the caches; smaller ones stay in them, and gathering the batch would only cost).
const BATCH_MIN_ENTRIES: usize = 1 << 14;

/// Packed keys to entry indices: open addressing with linear probing, at most half full,
/// found through a keyed hash. A lookup splits in two, hashing the key and prefetching its
/// slot, then reading it, so a batch's cache misses overlap.
#[derive(Debug)]
struct PackedMap {
    /// (key, entry); entry [`EMPTY_SLOT`] for none.
    slots: Box<[(u128, u32)]>,
    mask: usize,
    hasher: KeyedHash,
    len: usize,
}

const EMPTY_SLOT: u32 = u32::MAX;

impl PackedMap {
    /// Later entries of the same key replace earlier ones.
    fn new(items: Vec<(u128, usize)>) -> PackedMap {
        let n = (items.len() * 2).next_power_of_two().max(16);
        let slots = vec![(0, EMPTY_SLOT); n];
        let mut map = PackedMap {
            slots: slots.into_boxed_slice(),
            mask: n - 1,
            hasher: KeyedHash::new(),
            len: items.len(),
        };
        for (key, entry) in items {
            let mut i = map.home(map.hash(key));
            while map.slots[i].1 != EMPTY_SLOT && map.slots[i].0 != key {
                i = (i + 1) & map.mask;
            }
            map.slots[i] = (key, u32::try_from(entry).expect("fewer than 4G entries"));
        }
        map
    }

    #[inline(always)]
    fn hash(&self, key: u128) -> u64 {
        self.hasher.hash([key as u64, (key >> 64) as u64])
    }

    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        hash as usize & self.mask
    }

    #[inline(always)]
    fn prefetch(&self, hash: u64) {
        prefetch(&self.slots[self.home(hash)]);
    }

    #[inline(always)]
    fn get(&self, key: u128, hash: u64) -> Option<usize> {
        let mut i = self.home(hash);
        loop {
            let (k, entry) = self.slots[i];
            if entry == EMPTY_SLOT {
                return None;
            }
            if k == key {
                return Some(entry as usize);
            }
            i = (i + 1) & self.mask;
        }
    }
}

/// Packs one value per field into an integer, each in its field's width; `None` when
/// they do not fit in 128 bits.
fn pack(fields: &[Field], values: impl IntoIterator<Item = u128>) -> Option<u128> {
    let mut key = 0u128;
    let mut used = 0u32;
    for (f, v) in fields.iter().zip(values) {
        let bits = u32::from(f.kind().bits());
        used += bits;
        if used > 128 {
            return None;
        }
        key = if bits == 128 { v } else { key << bits | v };
    }
    Some(key)
}

impl ExactTable {
    pub fn new<'a>(fields: &[Field], keys: impl IntoIterator<Item = &'a [u128]>) -> ExactTable {
        let width: u32 = fields.iter().map(|f| u32::from(f.kind().bits())).sum();
        let map = if width <= 128 {
            ExactMap::Packed(PackedMap::new(
                keys.into_iter()
                    .enumerate()
                    .map(|(i, k)| (pack(fields, k.iter().copied()).expect("width checked"), i))
                    .collect(),
            ))
        } else {
            ExactMap::Wide(
                keys.into_iter()
                    .enumerate()
                    .map(|(i, k)| (Box::from(k), i))
                    .collect(),
            )
        };
        ExactTable {
            readers: fields
                .iter()
                .map(|f| (field::FieldReader::new(*f), u32::from(f.kind().bits())))
                .collect(),
            map,
        }
    }

    /// The packet's key packed as the table packs its keys; `None` when a field is absent.
    #[inline]
    fn packed_key(&self, pkt: &PacketView<'_>) -> Option<u128> {
        let mut key = 0u128;
        for &(read, bits) in self.readers.iter() {
            let v = read.read(pkt.frame, pkt.meta, pkt.state)?;
            key = if bits == 128 { v } else { key << bits | v };
        }
        Some(key)
    }

    /// Whether [`ExactTable::lookup_batch`] beats looking packets up one by one: for tables
    /// too large for the caches.
    pub fn batches(&self) -> bool {
        matches!(&self.map, ExactMap::Packed(m) if m.len >= BATCH_MIN_ENTRIES)
    }

    /// [`ExactTable::lookup`] for many packets: every key hashed and its slot prefetched
    /// first, 32 at a time, then the slots read.
    pub fn lookup_batch(&self, pkts: &[PacketView<'_>], out: &mut [Option<usize>]) {
        const CHUNK: usize = 32;
        let ExactMap::Packed(map) = &self.map else {
            for (p, o) in pkts.iter().zip(out) {
                *o = self.lookup(p);
            }
            return;
        };
        let mut keys = [None; CHUNK];
        let mut hashes = [0u64; CHUNK];
        for (pkts, out) in pkts.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
            for ((k, h), p) in keys.iter_mut().zip(&mut hashes).zip(pkts) {
                *k = self.packed_key(p);
                if let Some(key) = *k {
                    *h = map.hash(key);
                    map.prefetch(*h);
                }
            }
            for ((o, k), h) in out.iter_mut().zip(&keys).zip(&hashes) {
                *o = k.and_then(|key| map.get(key, *h));
            }
        }
    }

    #[inline(always)]
    pub fn lookup(&self, pkt: &PacketView<'_>) -> Option<usize> {
        match &self.map {
            ExactMap::Packed(map) => {
                let key = self.packed_key(pkt)?;
                map.get(key, map.hash(key))
            }
            ExactMap::Wide(map) => {
                let mut key = [0u128; MAX_EXACT_FIELDS];
                for (slot, &(read, _)) in key.iter_mut().zip(self.readers.iter()) {
                    *slot = read.read(pkt.frame, pkt.meta, pkt.state)?;
                }
                map.get(&key[..self.readers.len()]).copied()
            }
        }
    }
}

/// Rule pipes of many rules classify with the firewall's decision trees when every
/// match can be said as a range per 32-bit word (see `Layout`).
pub fn rule_trees(rules: &[Rule]) -> Option<Box<dyn RuleClassifier>> {
    let layout = Layout::new(rules)?;
    // A few key widths, so a 5-tuple key (six words with its family word) stays small.
    Some(match layout.words {
        0..=6 => Box::new(RuleTrees::<6>::new(layout, rules)?),
        7..=8 => Box::new(RuleTrees::<8>::new(layout, rules)?),
        9..=acl::MAX_FIELDS => Box::new(RuleTrees::<{ acl::MAX_FIELDS }>::new(layout, rules)?),
        _ => return None,
    })
}

/// Pipes with fewer rules than this keep the plain scan.
pub const TREE_MIN_RULES: usize = 64;

/// Where one matched field sits in a classifier key.
#[derive(Debug, Clone, Copy)]
struct Slot {
    field: Field,
    reader: field::Reader,
    /// Its first word; an IPv6 address takes four, most significant first.
    at: usize,
    read: Read,
}

/// How a slot's words come from the packet.
#[derive(Debug, Clone, Copy)]
enum Read {
    /// One word; `absent` when the packet lacks the field.
    Narrow { absent: u32 },
    /// An address of one word (IPv4) or four (IPv6); when present, the word `family`
    /// (which IP version the packet has at this depth) says so.
    Address {
        words: usize,
        family: usize,
        version: u32,
    },
}

impl Slot {
    fn family(&self) -> Option<usize> {
        match self.read {
            Read::Narrow { .. } => None,
            Read::Address { family, .. } => Some(family),
        }
    }
}

/// Values of a family word (no IP header, IPv4, IPv6, a rule asking for both).
const FAMILY_NONE: u32 = 0;
const FAMILY_V4: u32 = 1;
const FAMILY_V6: u32 = 2;
const FAMILY_BOTH: u32 = 3;

/// The key layout: each matched field as words. A field narrower than 32 bits reads
/// `1 << bits` when the packet lacks it, a value no rule range contains unless the rule
/// leaves the field open; addresses fill all 32 bits, so their presence is the family word.
#[derive(Debug, Clone)]
struct Layout {
    slots: Vec<Slot>,
    words: usize,
}

impl Layout {
    fn new(rules: &[Rule]) -> Option<Layout> {
        let mut fields: Vec<Field> = rules
            .iter()
            .flat_map(|r| r.matches.iter().map(|m| m.field))
            .collect();
        // Addresses then ports first: the trees group rules by how open these are.
        let rank = |f: &Field| match f.id {
            FieldId::Ipv4Src | FieldId::Ipv6Src => 0,
            FieldId::Ipv4Dst | FieldId::Ipv6Dst => 1,
            FieldId::L4Src | FieldId::TcpSrc | FieldId::UdpSrc => 2,
            FieldId::L4Dst | FieldId::TcpDst | FieldId::UdpDst => 3,
            _ => 4,
        };
        fields.sort_by_key(|f| (rank(f), *f));
        fields.dedup();
        let mut words = 0;
        let mut families = [None; 2];
        let mut slots = Vec::with_capacity(fields.len());
        for field in fields {
            let width = match (field.id, field.kind()) {
                (FieldId::GeneveOptClass | FieldId::GeneveOptType, _) => return None,
                // Addresses the family word cannot vouch for: an ARP frame is not IPv4,
                // and an IPv6 packet need not be a neighbour discovery message.
                (FieldId::ArpSpa | FieldId::ArpTpa | FieldId::NdTarget, _) => return None,
                (_, ValueKind::Ipv4) => 1,
                (_, ValueKind::Ipv6) => 4,
                (_, k) if k.bits() < 32 => 0,
                _ => return None,
            };
            let read = if width == 0 {
                Read::Narrow {
                    absent: 1 << field.kind().bits(),
                }
            } else {
                let family = *families[usize::from(field.inner)].get_or_insert_with(|| {
                    words += 1;
                    words - 1
                });
                let version = if width == 1 { FAMILY_V4 } else { FAMILY_V6 };
                Read::Address {
                    words: width,
                    family,
                    version,
                }
            };
            slots.push(Slot {
                field,
                reader: field::reader(field),
                at: words,
                read,
            });
            words += width.max(1);
        }
        Some(Layout { slots, words })
    }

    /// Where the words of an outer five-tuple key sit, when the key is made of those
    /// fields only (any of them; addresses of one IP version), as ClassBench rule sets and
    /// most firewalls have it.
    fn five_tuple(&self) -> Option<FiveTuple> {
        let mut t = FiveTuple::default();
        let mut versions = 0;
        for s in &self.slots {
            let at = Some(s.at);
            match (s.field.id, s.field.inner) {
                (FieldId::Ipv4Src, false) => {
                    (t.src, t.family, versions) = (at, s.family(), versions | 1)
                }
                (FieldId::Ipv4Dst, false) => {
                    (t.dst, t.family, versions) = (at, s.family(), versions | 1)
                }
                (FieldId::Ipv6Src, false) => {
                    (t.src, t.family, versions) = (at, s.family(), versions | 2)
                }
                (FieldId::Ipv6Dst, false) => {
                    (t.dst, t.family, versions) = (at, s.family(), versions | 2)
                }
                (FieldId::L4Src, false) => t.sport = at,
                (FieldId::L4Dst, false) => t.dport = at,
                (FieldId::IpProto, false) => t.proto = at,
                _ => return None,
            }
        }
        t.v6 = match versions {
            0 | 1 => false,
            2 => true,
            _ => return None,
        };
        Some(t)
    }

    fn space<const N: usize>(&self) -> acl::Space<N> {
        let mut space = acl::Space {
            max: [0; N],
            open_bits: [0; N],
            span: [0; N],
        };
        for s in &self.slots {
            match s.field.kind() {
                ValueKind::Ipv4 | ValueKind::Ipv6 => {
                    let words = s.field.kind().bits() as usize / 32;
                    space.max[s.at..s.at + words].fill(u32::MAX);
                    // Open from a /16 (IPv4) or a /48 (IPv6).
                    space.open_bits[s.at] = if words == 1 { 16 } else { 80 };
                    space.span[s.at] = words as u8;
                }
                k => {
                    space.max[s.at] = 1 << k.bits();
                    if matches!(
                        s.field.id,
                        FieldId::L4Src
                            | FieldId::L4Dst
                            | FieldId::TcpSrc
                            | FieldId::TcpDst
                            | FieldId::UdpSrc
                            | FieldId::UdpDst
                    ) {
                        space.open_bits[s.at] = 12;
                    }
                }
            }
            if let Some(f) = s.family() {
                space.max[f] = FAMILY_BOTH;
            }
        }
        space
    }

    /// The classifier rules for `r`: one per combination of the values its sets allow,
    /// consecutive, so the first to match still names the first pipe rule that matches.
    /// `None` when a match is not ranges per word plus at most two bit-mask tests.
    fn rules<const N: usize>(&self, r: &Rule, space: &acl::Space<N>) -> Option<Vec<acl::Rule<N>>> {
        let mut out = vec![acl::Rule::any(space.max)];
        for m in &r.matches {
            let s = self.slots.iter().find(|s| s.field == m.field)?;
            let alternatives = match &m.pattern {
                Pattern::Any(ps) => ps.as_slice(),
                p => std::slice::from_ref(p),
            };
            if out.len() * alternatives.len() > MAX_COMBINATIONS {
                return None;
            }
            out = out
                .iter()
                .flat_map(|base| {
                    alternatives.iter().map(move |p| {
                        let mut r = *base;
                        apply(&mut r, s, p, space).map(|()| r)
                    })
                })
                .collect::<Option<_>>()?;
        }
        Some(out)
    }
}

/// Most classifier rules one pipe rule may become (sets on several fields multiply).
const MAX_COMBINATIONS: usize = 64;

/// Narrows `out` to packets whose field in slot `s` matches `pattern` (a range or a mask).
fn apply<const N: usize>(
    out: &mut acl::Rule<N>,
    s: &Slot,
    pattern: &Pattern,
    space: &acl::Space<N>,
) -> Option<()> {
    let narrow = |out: &mut acl::Rule<N>, at: usize, lo: u32, hi: u32| {
        out.lo[at] = out.lo[at].max(lo);
        out.hi[at] = out.hi[at].min(hi);
    };
    let kind = s.field.kind();
    let words = kind.bits().div_ceil(32) as usize;
    if let Some(f) = s.family() {
        let want = if kind == ValueKind::Ipv4 {
            FAMILY_V4
        } else {
            FAMILY_V6
        };
        let have = out.lo[f];
        let v = if have == 0 || have == want {
            want
        } else {
            FAMILY_BOTH
        };
        (out.lo[f], out.hi[f]) = (v, v);
    } else {
        // Leave out the value an absent field reads as.
        narrow(out, s.at, 0, space.max[s.at] - 1);
    }
    let (lo, hi) = match *pattern {
        Pattern::Range { lo, hi } if words == 1 => (lo, hi),
        Pattern::Masked { value, mask } => {
            let host = !mask & kind.full_mask();
            if host & host.wrapping_add(1) == 0 {
                // Contiguous host bits: an aligned block, so a range in every word.
                (value, value | host)
            } else {
                let free = out.masked.iter().position(|m| m.mask == 0);
                let (Some(t), 1) = (free, words) else {
                    return None;
                };
                out.masked[t] = acl::Masked {
                    field: s.at as u8,
                    value: value as u32,
                    mask: mask as u32,
                };
                return Some(());
            }
        }
        // IPv6 ranges that are not prefixes do not split into per-word ranges.
        _ => return None,
    };
    for w in 0..words {
        let shift = 32 * (words - 1 - w);
        narrow(out, s.at + w, (lo >> shift) as u32, (hi >> shift) as u32);
    }
    Some(())
}

/// The key words of the outer five-tuple fields a layout has ([`Layout::five_tuple`]).
#[derive(Debug, Clone, Copy, Default)]
struct FiveTuple {
    /// The addresses are IPv6 ones (four words each).
    v6: bool,
    family: Option<usize>,
    src: Option<usize>,
    dst: Option<usize>,
    sport: Option<usize>,
    dport: Option<usize>,
    proto: Option<usize>,
}

impl FiveTuple {
    /// Writes the key of `pkt` to `key`, read in one go: the fields' shared tests (IPv4?
    /// ports present?)
    /// made once, where the general builder calls a reader per field. Each word as that
    /// field's reader and slot give it. (Which words a layout has is the same for every
    /// packet, so the branches on them are predicted.)
    #[inline]
    fn write_key<const N: usize>(&self, pkt: &PacketView<'_>, key: &mut acl::Key<N>) {
        key.0 = [FAMILY_NONE; N];
        let (frame, l) = (pkt.frame, &pkt.meta.outer);
        let mut put = |at: Option<usize>, v: u32| {
            if let Some(w) = at.and_then(|at| key.0.get_mut(at)) {
                *w = v;
            }
        };
        let l3 = usize::from(l.l3);
        match (self.v6, l.l3_kind) {
            (false, L3::V4) => {
                put(self.family, FAMILY_V4);
                put(self.src, be32(frame, l3 + 12));
                put(self.dst, be32(frame, l3 + 16));
            }
            (true, L3::V6) => {
                put(self.family, FAMILY_V6);
                for (at, offset) in [(self.src, 8), (self.dst, 24)] {
                    let a = be128(frame, l3 + offset);
                    for w in 0..4 {
                        put(at.map(|at| at + w), (a >> (96 - 32 * w)) as u32);
                    }
                }
            }
            _ => {}
        }
        let l4 = usize::from(l.l4);
        if ip_proto::has_ports(l.proto) && l4_fields(frame, l) {
            put(self.sport, u32::from(be16(frame, l4)));
            put(self.dport, u32::from(be16(frame, l4 + 2)));
        } else {
            put(self.sport, 1 << 16);
            put(self.dport, 1 << 16);
        }
        put(
            self.proto,
            if l.l3_kind == L3::None {
                1 << 8
            } else {
                u32::from(l.proto)
            },
        );
    }
}

/// Ordered rules as decision trees over the words of a `Layout`.
#[derive(Debug)]
pub struct RuleTrees<const N: usize> {
    layout: Layout,
    /// The layout's key is outer five-tuple fields, built by [`FiveTuple::write_key`].
    five_tuple: Option<FiveTuple>,
    acl: acl::FixedClassifier<N>,
    /// The pipe rule each classifier rule comes from.
    pipe_rule: Vec<usize>,
}

impl<const N: usize> RuleTrees<N> {
    fn new(layout: Layout, rules: &[Rule]) -> Option<RuleTrees<N>> {
        let space = layout.space::<N>();
        let mut out = Vec::with_capacity(rules.len());
        let mut pipe_rule = Vec::with_capacity(rules.len());
        for (i, r) in rules.iter().enumerate() {
            let expanded = layout.rules(r, &space)?;
            pipe_rule.extend(std::iter::repeat_n(i, expanded.len()));
            out.extend(expanded);
        }
        Some(RuleTrees {
            acl: acl::FixedClassifier::new(space, &out),
            pipe_rule,
            five_tuple: layout.five_tuple(),
            layout,
        })
    }
}

impl<const N: usize> RuleTrees<N> {
    /// The classifier key of a packet: each slot's field read into its words.
    #[inline]
    fn key(&self, pkt: &PacketView<'_>) -> acl::Key<N> {
        let mut key = acl::Key([FAMILY_NONE; N]);
        self.write_key(pkt, &mut key);
        key
    }

    /// [`RuleTrees::key`] written in place: a batch's keys go straight into the array the
    /// classifier reads later (a key built on the stack and copied out was read back, as
    /// wider loads, right after its words were stored, and waited for them).
    #[inline]
    fn write_key(&self, pkt: &PacketView<'_>, key: &mut acl::Key<N>) {
        if let Some(t) = &self.five_tuple {
            return t.write_key(pkt, key);
        }
        key.0 = [FAMILY_NONE; N];
        for s in &self.layout.slots {
            let v = (s.reader)(pkt.frame, pkt.meta, pkt.state);
            match s.read {
                Read::Narrow { absent } => key.0[s.at] = v.map_or(absent, |v| v as u32),
                Read::Address {
                    words,
                    family,
                    version,
                } => {
                    if let Some(v) = v {
                        key.0[family] = version;
                        for w in 0..words {
                            key.0[s.at + w] = (v >> (32 * (words - 1 - w))) as u32;
                        }
                    }
                }
            }
        }
    }
}

impl<const N: usize> RuleClassifier for RuleTrees<N> {
    fn classify(&self, pkt: &PacketView<'_>) -> Option<usize> {
        self.acl
            .classify(&self.key(pkt))
            .and_then(|i| self.pipe_rule.get(i as usize).copied())
    }

    fn batches(&self) -> bool {
        true
    }

    /// The keys of up to 32 packets at a time, classified together.
    fn classify_batch(&self, pkts: &[PacketView<'_>], out: &mut [Option<usize>]) {
        const CHUNK: usize = 32;
        let mut keys = [acl::Key([FAMILY_NONE; N]); CHUNK];
        let mut found = [None; CHUNK];
        for (pkts, out) in pkts.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
            for (k, p) in keys.iter_mut().zip(pkts) {
                self.write_key(p, k);
            }
            let n = pkts.len();
            self.acl.classify_batch(&keys[..n], &mut found[..n]);
            for (o, f) in out.iter_mut().zip(&found[..n]) {
                *o = f.and_then(|i| self.pipe_rule.get(i as usize).copied());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::ActionList;
    use crate::wire::testing::frame as frame_of;
    use proptest::prelude::*;

    fn outer(id: FieldId) -> Field {
        Field { id, inner: false }
    }

    /// One of four nested prefixes of a small address pool (as v4 and as v6).
    fn prefix(v6: bool) -> impl Strategy<Value = Pattern> {
        (0u128..4, 0u8..=4).prop_map(move |(a, step)| {
            let kind = if v6 { ValueKind::Ipv6 } else { ValueKind::Ipv4 };
            let len = (u16::from(step) * u16::from(kind.bits()) / 4) as u8;
            Pattern::prefix(address(v6, a), len, kind)
        })
    }

    fn address(v6: bool, a: u128) -> u128 {
        if v6 {
            0x2001_0db8_u128 << 96 | a << 64 | a
        } else {
            0x0a00_0000 | a << 8 | a
        }
    }

    /// Matches over fifteen key words, the most a key holds.
    fn field_match() -> impl Strategy<Value = FieldMatch> {
        let port = (0u128..40, 0u128..40).prop_map(|(a, b)| Pattern::Range {
            lo: a.min(b),
            hi: a.max(b),
        });
        prop_oneof![
            prefix(false).prop_map(|p| FieldMatch {
                field: outer(FieldId::Ipv4Src),
                pattern: p
            }),
            prefix(false).prop_map(|p| FieldMatch {
                field: outer(FieldId::Ipv4Dst),
                pattern: p
            }),
            prefix(true).prop_map(|p| FieldMatch {
                field: outer(FieldId::Ipv6Src),
                pattern: p
            }),
            prefix(true).prop_map(|p| FieldMatch {
                field: outer(FieldId::Ipv6Dst),
                pattern: p
            }),
            port.clone().prop_map(|p| FieldMatch {
                field: outer(FieldId::L4Dst),
                pattern: p
            }),
            // Sets: `{a, b-c}` and `{6, 17}`.
            (0u128..40, port).prop_map(|(a, p)| FieldMatch {
                field: outer(FieldId::L4Dst),
                pattern: Pattern::Any(vec![Pattern::exact(a, ValueKind::Int { bits: 16 }), p]),
            }),
            Just(FieldMatch {
                field: outer(FieldId::IpProto),
                pattern: Pattern::Any(vec![
                    Pattern::exact(6, ValueKind::Int { bits: 8 }),
                    Pattern::exact(17, ValueKind::Int { bits: 8 })
                ]),
            }),
            prop_oneof![Just(6u128), Just(17), Just(1)].prop_map(|v| FieldMatch {
                field: outer(FieldId::IpProto),
                pattern: Pattern::exact(v, ValueKind::Int { bits: 8 }),
            }),
            // SYN without ACK, and ACK alone: bit masks, not ranges.
            prop_oneof![Just((0x02u128, 0x12u128)), Just((0x10, 0x10))].prop_map(
                |(value, mask)| {
                    FieldMatch {
                        field: outer(FieldId::TcpFlags),
                        pattern: Pattern::Masked { value, mask },
                    }
                }
            ),
            (0u128..64).prop_map(|d| FieldMatch {
                field: outer(FieldId::IpDscp),
                pattern: Pattern::Range { lo: d / 2, hi: d },
            }),
        ]
    }

    fn rules() -> impl Strategy<Value = Vec<Rule>> {
        proptest::collection::vec(proptest::collection::vec(field_match(), 0..4), 1..100)
            .prop_map(|rs| rs.into_iter().map(rule_of).collect())
    }

    /// An Ethernet frame: IPv4 or IPv6 carrying TCP, UDP or ICMP.
    fn frame() -> impl Strategy<Value = Vec<u8>> {
        (
            any::<bool>(),
            0u128..4,
            0u128..4,
            prop_oneof![Just(6u8), Just(17), Just(1)],
            0u16..45,
            0u16..45,
            any::<u8>(),
            0u8..64,
        )
            .prop_map(|(v6, s, d, proto, sport, dport, flags, dscp)| {
                frame_of(
                    v6,
                    address(v6, s),
                    address(v6, d),
                    proto,
                    sport,
                    dport,
                    flags,
                    dscp,
                )
            })
    }

    /// A table large enough to be looked up in batches gives what looking up one by one
    /// and a plain map give, for present and absent keys, and the later of two entries
    /// with the same key wins (as it did with the standard map).
    #[test]
    fn exact_tables_agree_batched_and_one_by_one() {
        let fields = [outer(FieldId::Ipv4Dst), outer(FieldId::L4Dst)];
        let n = BATCH_MIN_ENTRIES as u128 + 1000;
        let key = |i: u128| vec![0x0a00_0000 | i, 5000 + i % 1000];
        let mut keys: Vec<Vec<u128>> = (0..n).map(key).collect();
        keys.push(key(7));
        let table = ExactTable::new(&fields, keys.iter().map(Vec::as_slice));
        assert!(table.batches());
        let frames: Vec<Vec<u8>> = (0..200u128)
            .map(|i| {
                // Every third key is absent (its port is off by one).
                let k = key(i * 97 % (n + 50));
                let port = k[1] as u16 + u16::from(i % 3 == 0);
                frame_of(false, 0x0b00_0001, k[0], 17, 1234, port, 0, 0)
            })
            .collect();
        let state = PacketState::default();
        let metas = testing::parsed(&frames);
        let views = testing::views(&frames, &metas, &state);
        let mut batched = vec![None; views.len()];
        table.lookup_batch(&views, &mut batched);
        for (i, (v, b)) in views.iter().zip(&batched).enumerate() {
            let i = i as u128;
            let k = i * 97 % (n + 50);
            let want =
                (i % 3 != 0 && k < n).then_some(if k == 7 { n as usize } else { k as usize });
            assert_eq!(table.lookup(v), want, "packet {i}");
            assert_eq!(*b, want, "packet {i}, batched");
        }
    }

    fn narrow_pattern() -> impl Strategy<Value = Pattern> {
        let one = prop_oneof![
            (any::<u64>(), any::<u64>()).prop_map(|(v, m)| Pattern::Masked {
                value: u128::from(v & m),
                mask: u128::from(m),
            }),
            (any::<u64>(), any::<u64>()).prop_map(|(a, b)| Pattern::Range {
                lo: u128::from(a.min(b)),
                hi: u128::from(a.max(b)),
            }),
            (0u64..1000, 0u64..1000).prop_map(|(a, b)| Pattern::Range {
                lo: u128::from(a),
                hi: u128::from(b),
            }),
        ];
        prop_oneof![
            one.clone(),
            proptest::collection::vec(one, 0..4).prop_map(Pattern::Any)
        ]
    }

    proptest! {
        /// Narrow intervals hold for exactly the values their pattern does.
        #[test]
        fn narrow_intervals_match_as_their_patterns(
            p in narrow_pattern(),
            v in prop_oneof![any::<u64>(), 0u64..1000],
        ) {
            let test = Test::new(&FieldMatch { field: outer(FieldId::MetaMark), pattern: p.clone() });
            let (Test::Narrow { .. } | Test::NarrowSet { .. }) = test else {
                return Err(TestCaseError::fail("a narrow field"));
            };
            let held = Interval::of(&p).iter().any(|i| i.holds(v));
            prop_assert_eq!(held, p.matches(u128::from(v)));
        }
    }

    proptest! {
        /// The trees give the scan's answer for every packet, whatever fields the rules
        /// mix (both IP versions, ports, bit masks, fields the packet lacks), one packet
        /// at a time and as a batch (more than one chunk of keys).
        #[test]
        fn rule_trees_agree_with_the_scan(rules in rules(), frames in proptest::collection::vec(frame(), 1..80)) {
            trees_agree_with_the_scan(&rules, &frames)?;
        }
    }

    /// The trees of `rules` classify `frames` as the linear scan does, one packet at a
    /// time and as a batch.
    fn trees_agree_with_the_scan(rules: &[Rule], frames: &[Vec<u8>]) -> Result<(), TestCaseError> {
        let trees = rule_trees(rules).expect("every match is ranges or masks");
        let scan = LinearScan::new(rules);
        let state = PacketState::default();
        let metas = testing::parsed(frames);
        let views = testing::views(frames, &metas, &state);
        let mut batched = vec![None; views.len()];
        trees.classify_batch(&views, &mut batched);
        for (view, b) in views.iter().zip(batched) {
            let want = scan.classify(view);
            prop_assert_eq!(trees.classify(view), want);
            prop_assert_eq!(b, want);
        }
        Ok(())
    }

    /// A rule of `matches`, one a field.
    fn rule_of(mut matches: Vec<FieldMatch>) -> Rule {
        matches.sort_by_key(|m| m.field);
        matches.dedup_by_key(|m| m.field);
        Rule {
            name: String::new(),
            matches,
            actions: ActionList(Vec::new()),
        }
    }

    /// Matches on the outer five-tuple only, addresses of IP version `v6`: the layouts
    /// [`FiveTuple`] builds keys for.
    fn five_tuple_match(v6: bool) -> impl Strategy<Value = FieldMatch> {
        let (src, dst) = if v6 {
            (FieldId::Ipv6Src, FieldId::Ipv6Dst)
        } else {
            (FieldId::Ipv4Src, FieldId::Ipv4Dst)
        };
        let port = (0u128..40, 0u128..40).prop_map(|(a, b)| Pattern::Range {
            lo: a.min(b),
            hi: a.max(b),
        });
        prop_oneof![
            prefix(v6).prop_map(move |p| FieldMatch {
                field: outer(src),
                pattern: p
            }),
            prefix(v6).prop_map(move |p| FieldMatch {
                field: outer(dst),
                pattern: p
            }),
            port.clone().prop_map(|p| FieldMatch {
                field: outer(FieldId::L4Src),
                pattern: p
            }),
            port.prop_map(|p| FieldMatch {
                field: outer(FieldId::L4Dst),
                pattern: p
            }),
            prop_oneof![Just(6u128), Just(17), Just(1)].prop_map(|v| FieldMatch {
                field: outer(FieldId::IpProto),
                pattern: Pattern::exact(v, ValueKind::Int { bits: 8 }),
            }),
        ]
    }

    proptest! {
        /// Keys of five-tuple layouts (IPv4 or IPv6 addresses), built in one go, classify as
        /// the scan does: packets of either version, with and without ports.
        #[test]
        fn five_tuple_keys_agree_with_the_scan(
            rules in any::<bool>().prop_flat_map(|v6| proptest::collection::vec(proptest::collection::vec(five_tuple_match(v6), 1..5), 1..100)),
            frames in proptest::collection::vec(frame(), 1..80),
        ) {
            let rules: Vec<Rule> = rules.into_iter().map(rule_of).collect();
            prop_assert!(Layout::new(&rules).and_then(|l| l.five_tuple()).is_some());
            trees_agree_with_the_scan(&rules, &frames)?;
        }
    }

    #[test]
    fn layouts_pick_words_per_field() {
        let m = |id, pattern| FieldMatch {
            field: outer(id),
            pattern,
        };
        let any_port = Pattern::Range { lo: 0, hi: 65535 };
        let v6 = vec![Rule {
            name: String::new(),
            matches: vec![
                m(FieldId::Ipv6Src, Pattern::prefix(1, 64, ValueKind::Ipv6)),
                m(FieldId::Ipv6Dst, Pattern::prefix(1, 64, ValueKind::Ipv6)),
                m(FieldId::L4Dst, any_port.clone()),
            ],
            actions: ActionList(Vec::new()),
        }];
        // A family word, four words per address, one for the port.
        assert_eq!(Layout::new(&v6).map(|l| l.words), Some(10));
        let mac = vec![Rule {
            name: String::new(),
            matches: vec![m(FieldId::EthSrc, Pattern::exact(1, ValueKind::Mac))],
            actions: ActionList(Vec::new()),
        }];
        assert!(
            rule_trees(&mac).is_none(),
            "48-bit fields stay with the scan"
        );
    }
}
