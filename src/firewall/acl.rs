//! The rule classifier: priority rules as an inclusive range per key word plus up to two
//! bit-mask tests, first match in priority order wins. Keys are up to fifteen 32-bit
//! words; the firewall's 5-tuple (prefixes, port ranges, protocol with mask) is one layout
//! ([`FIVE_TUPLE`]), and the engine lays out any rule pipe's fields as words
//! (`engine::table`).
//!
//! Lookups walk HyperSplit-style decision trees: each inner node splits one field's range
//! at a threshold, each leaf holds a few rules in priority order that are checked in full.
//! Building cuts the space where it balances the rules best, and stops early in a region
//! that one rule covers completely (the rules after it are unreachable there). Rules are
//! first separated by which fields they leave wide open (as EffiCuts does), one tree per
//! group: a wildcard rule in the same tree as specific ones would be copied into every
//! small region the specific ones cut, and firewall-style sets would blow up. A lookup
//! visits the trees in order of their best priority and skips those that cannot beat the
//! match found so far. Updates do not rebuild the
//! tree: deletions mark the rule dead, insertions go to a small list checked beside the
//! tree; [`Classifier::rebuild`] folds them in. Rules that never change (a loaded
//! pipeline's) use [`FixedClassifier`], which skips the snapshot loads updates need.

use crate::engine::prefetch::prefetch_span;
use crate::lang::classbench::ClassBenchRule;
use arc_swap::ArcSwap;
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Fields of the 5-tuple classifier, in key order: source and destination address,
/// source and destination port, protocol. Classifiers over other fields use another `N`.
pub const FIELDS: usize = 5;

/// What a classifier's fields hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space<const N: usize> {
    /// The largest value of each field.
    pub max: [u32; N],
    /// Per field, from how many free bits a rule counts as open on it when rules are
    /// grouped into trees (0: not a grouping field; the first four non-zero count). Set
    /// on a field's first word.
    pub open_bits: [u8; N],
    /// Per field's first word, how many words the field takes (an IPv6 address four);
    /// 0 or 1 for one.
    pub span: [u8; N],
}

/// The 5-tuple: addresses are open from a /16, ports from 4096 values.
pub const FIVE_TUPLE: Space<FIELDS> = Space {
    max: [u32::MAX, u32::MAX, 65535, 65535, 255],
    open_bits: [16, 16, 12, 12, 0],
    span: [1; FIELDS],
};

/// Most fields a classifier handles (a node names its field in a byte; fifteen keep
/// a key within a cache line).
pub const MAX_FIELDS: usize = 15;

/// A packet's key: one value per field (the 5-tuple by default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key<const N: usize = FIELDS>(pub [u32; N]);

impl<const N: usize> Default for Key<N> {
    fn default() -> Self {
        Key([0; N])
    }
}

impl Key {
    pub fn new(src: u32, dst: u32, sport: u16, dport: u16, proto: u8) -> Key {
        Key([
            src,
            dst,
            u32::from(sport),
            u32::from(dport),
            u32::from(proto),
        ])
    }
}

/// A value/mask test on one field (`mask` 0: no test).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Masked {
    pub field: u8,
    pub value: u32,
    pub mask: u32,
}

/// A rule: an inclusive range per field, plus up to two value/mask tests for what ranges
/// cannot say (a protocol under a partial mask, TCP flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule<const N: usize = FIELDS> {
    pub lo: [u32; N],
    pub hi: [u32; N],
    pub masked: [Masked; 2],
}

impl<const N: usize> Rule<N> {
    /// A rule that matches everything in `space`.
    pub fn any(space: [u32; N]) -> Rule<N> {
        Rule {
            lo: [0; N],
            hi: space,
            masked: [Masked::default(); 2],
        }
    }

    /// Every test is evaluated and combined without a branch: whether a leaf's rules match
    /// is unpredictable, and a mispredicted branch costs more than the compares it skips.
    #[inline]
    pub fn matches(&self, k: &Key<N>) -> bool {
        in_ranges(&self.lo, &self.hi, k) & passes(&self.masked, k)
    }

    /// Whether every key of the region matches (a masked test may always fail somewhere).
    fn covers(&self, lo: &[u32; N], hi: &[u32; N]) -> bool {
        (0..N).all(|f| self.lo[f] <= lo[f] && hi[f] <= self.hi[f])
            && self.masked.iter().all(|m| m.mask == 0)
    }
}

/// Whether every field of `k` is within its range (a rule without value/mask tests
/// matches exactly then), the compares combined without branches.
#[inline]
fn in_ranges<const N: usize>(lo: &[u32; N], hi: &[u32; N], k: &Key<N>) -> bool {
    let v = &k.0;
    (0..N).fold(true, |ok, f| ok & (lo[f] <= v[f]) & (v[f] <= hi[f]))
}

/// Whether `k` passes the value/mask tests (one with mask 0 passes whatever the word).
#[inline]
fn passes<const N: usize>(tests: &[Masked; 2], k: &Key<N>) -> bool {
    let v = &k.0;
    tests.iter().fold(true, |ok, m| {
        ok & (v[usize::from(m.field).min(N - 1)] & m.mask == m.value & m.mask)
    })
}

fn prefix_range(addr: u32, len: u8) -> (u32, u32) {
    let mask = if len == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(len.min(32)))
    };
    (addr & mask, (addr & mask) | !mask)
}

/// A protocol value/mask as the range the trees split on plus, for a partial mask, the
/// test the leaves check on word `field`.
fn protocol(value: u8, mask: u8, field: u8) -> ((u32, u32), [Masked; 2]) {
    let value = value & mask;
    let mut masked = [Masked::default(); 2];
    let range = match mask {
        0xff => (u32::from(value), u32::from(value)),
        0 => (0, 255),
        _ => {
            masked[0] = Masked {
                field,
                value: u32::from(value),
                mask: u32::from(mask),
            };
            (0, 255)
        }
    };
    (range, masked)
}

impl From<&ClassBenchRule> for Rule {
    fn from(r: &ClassBenchRule) -> Rule {
        let (s0, s1) = prefix_range(r.src.0, r.src.1);
        let (d0, d1) = prefix_range(r.dst.0, r.dst.1);
        let ((p0, p1), masked) = protocol(r.proto.0, r.proto.1, 4);
        Rule {
            lo: [s0, d0, u32::from(r.sport.0), u32::from(r.dport.0), p0],
            hi: [s1, d1, u32::from(r.sport.1), u32::from(r.dport.1), p1],
            masked,
        }
    }
}

/// Words of an IPv6 5-tuple key: source and destination address (four words each, most
/// significant first), source and destination port, protocol.
pub const IPV6_FIELDS: usize = 11;

/// The IPv6 5-tuple: grouped by how open each address and port range is.
pub const IPV6_FIVE_TUPLE: Space<IPV6_FIELDS> = Space {
    max: [
        u32::MAX,
        u32::MAX,
        u32::MAX,
        u32::MAX,
        u32::MAX,
        u32::MAX,
        u32::MAX,
        u32::MAX,
        65535,
        65535,
        255,
    ],
    // A /48 or shorter is open, as a /16 is for IPv4.
    open_bits: [80, 0, 0, 0, 80, 0, 0, 0, 12, 12, 0],
    span: [4, 0, 0, 0, 4, 0, 0, 0, 1, 1, 1],
};

/// An IPv6 address as four words, most significant first.
fn words(a: u128) -> [u32; 4] {
    std::array::from_fn(|w| (a >> (96 - 32 * w)) as u32)
}

/// One line of an IPv6 rule file as `dpdk-test-acl --ipv6` reads it:
/// `@SRC/LEN DST/LEN SPORT : SPORT DPORT : DPORT PROTO/MASK`, addresses in IPv6 notation.
fn parse_rule_v6(line: &str) -> Option<Rule<IPV6_FIELDS>> {
    let t: Vec<&str> = line.trim_start_matches('@').split_whitespace().collect();
    let [src, dst, sp0, ":", sp1, dp0, ":", dp1, proto, ..] = t[..] else {
        return None;
    };
    let prefix = |p: &str| -> Option<(u128, u128)> {
        let (a, len) = p.split_once('/')?;
        let a = u128::from(a.parse::<std::net::Ipv6Addr>().ok()?);
        let len: u32 = len.parse().ok().filter(|l| *l <= 128)?;
        let host = u128::MAX.checked_shr(len).unwrap_or(0);
        Some((a & !host, a | host))
    };
    let port = |w: &str| integer_upto(w, 65535);
    let (s, d) = (prefix(src)?, prefix(dst)?);
    let (pv, pm) = proto.split_once('/')?;
    let byte = |w: &str| integer_upto(w, 255).map(|v| v as u8);
    let ((p0, p1), masked) = protocol(byte(pv)?, byte(pm)?, 10);
    let (slo, shi, dlo, dhi) = (words(s.0), words(s.1), words(d.0), words(d.1));
    let mut lo = [0; IPV6_FIELDS];
    let mut hi = [0; IPV6_FIELDS];
    lo[..4].copy_from_slice(&slo);
    hi[..4].copy_from_slice(&shi);
    lo[4..8].copy_from_slice(&dlo);
    hi[4..8].copy_from_slice(&dhi);
    (lo[8], hi[8], lo[9], hi[9]) = (port(sp0)?, port(sp1)?, port(dp0)?, port(dp1)?);
    (lo[10], hi[10]) = (p0, p1);
    Some(Rule { lo, hi, masked })
}

/// [`parse_rule_v6`] with the file format named on a malformed line, and empty port
/// ranges refused as IPv4 rule files refuse them.
fn rule_v6(line: &str) -> Result<Rule<IPV6_FIELDS>, String> {
    let r = parse_rule_v6(line).ok_or_else(|| {
        "expected `@SRC/LEN DST/LEN SPORT : SPORT DPORT : DPORT PROTO/MASK`".to_owned()
    })?;
    for f in [8, 9] {
        if r.lo[f] > r.hi[f] {
            let e = crate::lang::classbench::LineError::EmptyRange(r.lo[f] as u16, r.hi[f] as u16);
            return Err(e.to_string());
        }
    }
    Ok(r)
}

/// The parsed non-empty lines of a file; errors name the file and line.
fn read_lines<T>(
    path: &std::path::Path,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Result<Vec<T>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| parse(l).map_err(|e| format!("{}:{}: {e}", path.display(), n + 1)))
        .collect()
}

const TRACE_FORMAT: &str = "expected `SRC DST SPORT DPORT PROTO`";

/// An integer of at most `max`, decimal or 0x-hexadecimal.
fn integer_upto(w: &str, max: u32) -> Option<u32> {
    crate::lang::value::integer(w)
        .and_then(|v| u32::try_from(v).ok())
        .filter(|v| *v <= max)
}

/// Reads an IPv6 rule file (see `parse_rule_v6`).
pub fn load_rules_v6(path: &std::path::Path) -> Result<Vec<Rule<IPV6_FIELDS>>, String> {
    read_lines(path, rule_v6)
}

/// One IPv6 trace line: `SRC DST SPORT DPORT PROTO`, addresses in IPv6 notation.
fn parse_trace_v6(line: &str) -> Option<Key<IPV6_FIELDS>> {
    let t: Vec<&str> = line.split_whitespace().collect();
    let [src, dst, sp, dp, proto] = t[..] else {
        return None;
    };
    let addr = |w: &str| w.parse::<std::net::Ipv6Addr>().ok().map(u128::from);
    let mut k = [0; IPV6_FIELDS];
    k[..4].copy_from_slice(&words(addr(src)?));
    k[4..8].copy_from_slice(&words(addr(dst)?));
    k[8] = integer_upto(sp, 65535)?;
    k[9] = integer_upto(dp, 65535)?;
    k[10] = integer_upto(proto, 255)?;
    Some(Key(k))
}

/// Reads an IPv6 trace (see `parse_trace_v6`).
pub fn load_trace_v6(path: &std::path::Path) -> Result<Vec<Key<IPV6_FIELDS>>, String> {
    read_lines(path, |l| {
        parse_trace_v6(l).ok_or_else(|| TRACE_FORMAT.to_owned())
    })
}

/// Inserted rules kept beside the trees (checked linearly) before a rebuild folds them in.
const MAX_ADDED: usize = 256;

/// How long the list may grow while a rebuild runs before writers wait for it: lookups
/// scan it (the part of it ahead of each key's match in the trees).
const MAX_PENDING: usize = 4 * MAX_ADDED;

/// Rules a leaf may hold before the builder tries to split it.
const LEAF_RULES: usize = 3;

/// The least depth a tree may be capped at (see `Tree::build`).
const MIN_DEPTH_CAP: usize = 13;

/// The most rules a leaf at the depth cap may hold: a region with more is split further
/// all the same, so no rule set can make a lookup scan a long leaf.
const CAPPED_LEAF_RULES: usize = 16;

/// A tree node. An inner node sends `key[field] <= threshold` to `child` and the rest to
/// `child + 1`. A leaf has `threshold == u32::MAX` (no split has it: a split leaves values
/// on both sides) and `child` equal to itself, so stepping from a leaf stays there: a
/// batch can descend branch-free, every key the same number of steps.
///
/// Packed in one word, so a step loads the node once: the threshold in the high half, the
/// child index above the field's four bits in the low half.
#[derive(Debug, Clone, Copy)]
struct Node(u64);

/// Nodes a tree may have (child indices take 28 bits); past that, regions stay leaves.
const MAX_NODES: usize = 1 << 28;

impl Node {
    fn inner(threshold: u32, child: usize, field: u8) -> Node {
        debug_assert!(child < MAX_NODES && field < 16);
        Node(u64::from(threshold) << 32 | (child as u64) << 4 | u64::from(field))
    }

    #[inline(always)]
    fn threshold(self) -> u32 {
        (self.0 >> 32) as u32
    }

    #[inline(always)]
    fn child(self) -> usize {
        (self.0 as u32 >> 4) as usize
    }

    #[inline(always)]
    fn field(self) -> usize {
        (self.0 & 15) as usize
    }

    /// The node a key goes to from here.
    #[inline(always)]
    fn next(self, k: &[u32]) -> usize {
        self.child() + usize::from(k[self.field()] > self.threshold())
    }

    /// [`Node::next`] for a key padded to 16 words (the field needs no bounds check).
    #[inline(always)]
    fn next_padded(self, k: &[u32; 16]) -> usize {
        self.child() + usize::from(k[self.field() & 15] > self.threshold())
    }
}

/// Keys a batched lookup takes at a time.
const CHUNK: usize = 32;

/// The indices of a whole chunk's keys (the first tree is descended by all of them).
const EVERY_KEY: [u8; CHUNK] = {
    let mut all = [0u8; CHUNK];
    let mut i = 0;
    while i < CHUNK {
        all[i] = i as u8;
        i += 1;
    }
    all
};

/// A rule as a leaf holds it: its ranges and id, its value/mask tests apart (most trees
/// have none, and a leaf's rules then take a third fewer bytes).
#[derive(Debug, Clone, Copy)]
struct LeafRule<const N: usize> {
    lo: [u32; N],
    hi: [u32; N],
    id: u32,
}

impl<const N: usize> LeafRule<N> {
    /// Whether `k` is within every range.
    #[inline]
    fn matches(&self, k: &Key<N>) -> bool {
        in_ranges(&self.lo, &self.hi, k)
    }
}

/// A built decision tree over a fixed set of rules.
#[derive(Debug, Clone)]
struct Tree<const N: usize> {
    nodes: Vec<Node>,
    /// Per node: the leaf's rules as `leaf[start..start + len]` (unused for inner nodes).
    spans: Vec<(u32, u32)>,
    /// The rules of every leaf, leaves back to back.
    leaf: Vec<LeafRule<N>>,
    /// Their value/mask tests, for trees where some rule has one; else empty (most rule
    /// sets have none: their leaves then compare ranges only).
    tests: Vec<[Masked; 2]>,
    /// Steps from the root to the deepest leaf.
    depth: usize,
    /// (covering rule, hidden rule) pairs: a rule that covers a whole region of the tree
    /// hides the rules after it there, which are then missing from that region's leaf.
    covering: Vec<(u32, u32)>,
}

struct Job<const N: usize> {
    node: usize,
    depth: usize,
    rules: Vec<u32>,
    lo: [u32; N],
    hi: [u32; N],
}

/// The depth past which a tree of `rules` rules leaves its regions of a few rules unsplit.
/// Every key of a batch takes the tree's full depth (see `Tree::lookup_batch`), so a few
/// deep regions of dense, overlapping rules cost every lookup; past this depth their leaves
/// hold more rules instead (at most [`CAPPED_LEAF_RULES`]), which costs only the keys
/// landing there. About log2 of the rules, 13 at least: ipc1_1k +7 %, ipc1_10k +4 %,
/// acl1_10k +3 %, no set slower.
fn depth_cap(rules: usize) -> usize {
    MIN_DEPTH_CAP.max(rules.next_power_of_two().trailing_zeros() as usize)
}

/// A leaf at node `at`.
fn leaf(at: usize) -> Node {
    Node::inner(u32::MAX, at, 0)
}

impl<const N: usize> Tree<N> {
    /// Builds over `rules` (id = priority: lower wins) given in priority order, in the
    /// region `0..=space`; `None` when the leaves would hold more than `max_leaf` copies,
    /// found as soon as the copies made plus the rules of the regions still to build pass
    /// it.
    fn build(rules: &[(u32, Rule<N>)], max_leaf: usize, space: [u32; N]) -> Option<Tree<N>> {
        Self::build_to(rules, max_leaf, space, depth_cap(rules.len()))
    }

    /// [`Tree::build`], regions of at most [`CAPPED_LEAF_RULES`] rules left as leaves from
    /// `depth_cap` levels down.
    fn build_to(
        rules: &[(u32, Rule<N>)],
        max_leaf: usize,
        space: [u32; N],
        depth_cap: usize,
    ) -> Option<Tree<N>> {
        const { assert!(N <= MAX_FIELDS) };
        let mut t = Tree {
            nodes: Vec::new(),
            spans: Vec::new(),
            leaf: Vec::new(),
            tests: Vec::new(),
            depth: 0,
            covering: Vec::new(),
        };
        t.nodes.push(leaf(0));
        let all: Vec<u32> = (0..rules.len() as u32).collect();
        let mut stack = vec![Job {
            node: 0,
            depth: 0,
            rules: all,
            lo: [0; N],
            hi: space,
        }];
        // Rules of the regions still on the stack: each will reach at least one leaf (but
        // for those a covering rule hides), so a build over budget stops early.
        let mut pending = rules.len();
        while let Some(mut job) = stack.pop() {
            pending -= job.rules.len();
            t.depth = t.depth.max(job.depth);
            // In this region the first rule that covers it all shadows every later one.
            if let Some(p) = job
                .rules
                .iter()
                .position(|&i| rules[i as usize].1.covers(&job.lo, &job.hi))
            {
                let cover = rules[job.rules[p] as usize].0;
                t.covering.extend(
                    job.rules[p + 1..]
                        .iter()
                        .map(|&h| (cover, rules[h as usize].0)),
                );
                job.rules.truncate(p + 1);
            }
            if t.leaf.len() + pending + job.rules.len() > max_leaf {
                return None;
            }
            let room = t.nodes.len() + 2 <= MAX_NODES;
            let deep = job.depth >= depth_cap && job.rules.len() <= CAPPED_LEAF_RULES;
            let split = if job.rules.len() > LEAF_RULES && !deep && room {
                best_split(rules, &job)
            } else {
                None
            };
            let Some((field, threshold)) = split else {
                let start = t.leaf.len() as u32;
                for &i in &job.rules {
                    let (id, r) = &rules[i as usize];
                    t.leaf.push(LeafRule {
                        lo: r.lo,
                        hi: r.hi,
                        id: *id,
                    });
                    t.tests.push(r.masked);
                }
                t.nodes[job.node] = leaf(job.node);
                if t.spans.len() <= job.node {
                    t.spans.resize(job.node + 1, (0, 0));
                }
                t.spans[job.node] = (start, job.rules.len() as u32);
                continue;
            };
            let f = usize::from(field);
            let left = t.nodes.len();
            t.nodes.push(leaf(left));
            t.nodes.push(leaf(left + 1));
            t.nodes[job.node] = Node::inner(threshold, left, field);
            let in_left: Vec<u32> = job
                .rules
                .iter()
                .copied()
                .filter(|&i| rules[i as usize].1.lo[f] <= threshold)
                .collect();
            let in_right: Vec<u32> = job
                .rules
                .iter()
                .copied()
                .filter(|&i| rules[i as usize].1.hi[f] > threshold)
                .collect();
            let (mut lhi, mut rlo) = (job.hi, job.lo);
            lhi[f] = threshold;
            rlo[f] = threshold + 1;
            pending += in_left.len() + in_right.len();
            stack.push(Job {
                node: left,
                depth: job.depth + 1,
                rules: in_left,
                lo: job.lo,
                hi: lhi,
            });
            stack.push(Job {
                node: left + 1,
                depth: job.depth + 1,
                rules: in_right,
                lo: rlo,
                hi: job.hi,
            });
        }
        t.spans.resize(t.nodes.len(), (0, 0));
        t.covering.sort_unstable();
        t.covering.dedup();
        if t.tests.iter().flatten().all(|m| m.mask == 0) {
            t.tests = Vec::new();
        }
        Some(t)
    }

    /// Starts loading the first rules of each leaf in `at`, so the scans that follow
    /// find them in cache instead of each waiting for its own.
    #[inline]
    fn prefetch_leaves(&self, at: &[u32]) {
        for &n in at {
            let (start, len) = self.spans[n as usize];
            if let Some(first) = self.leaf.get(start as usize) {
                prefetch_span(first);
                if len > 1 {
                    prefetch_span(&self.leaf[start as usize + 1]);
                }
            }
        }
    }

    /// The first live rule of leaf `node` that matches.
    #[inline]
    fn scan(&self, node: usize, k: &Key<N>, dead: &[AtomicU64]) -> Option<u32> {
        let (start, len) = self.spans[node];
        let span = start as usize..(start + len) as usize;
        let leaf = &self.leaf[span.clone()];
        let found = if !self.tests.is_empty() {
            leaf.iter()
                .zip(&self.tests[span])
                .find(|(r, t)| (r.matches(k) & passes(t, k)) && !is_dead(dead, r.id))
                .map(|(r, _)| r)
        } else {
            leaf.iter().find(|r| r.matches(k) && !is_dead(dead, r.id))
        };
        found.map(|r| r.id)
    }

    #[inline]
    fn lookup(&self, k: &Key<N>, dead: &[AtomicU64]) -> Option<u32> {
        let mut n = 0usize;
        loop {
            let nd = self.nodes[n];
            if nd.threshold() == u32::MAX {
                return self.scan(n, k, dead);
            }
            n = nd.next(&k.0);
        }
    }

    /// Descends the keys of a batch eight at a time in lockstep, branch-free, their node
    /// indices in registers, so the eight chains of loads overlap; each key ends at its
    /// leaf. Keys come padded to 16 words so a field index needs no bounds check.
    fn lookup_batch(&self, keys: &[[u32; 16]], at: &mut [u32]) {
        const LANES: usize = 8;
        // Node indices as machine words: no widening before each load.
        #[inline(always)]
        fn step(nodes: &[Node], n: &mut usize, k: &[u32; 16]) {
            *n = nodes[*n].next_padded(k);
        }
        let mut lanes = at.chunks_exact_mut(LANES);
        let mut ks = keys.chunks_exact(LANES);
        for (n, k) in (&mut lanes).zip(&mut ks) {
            let mut m = [0usize; LANES];
            for _ in 0..self.depth {
                for l in 0..LANES {
                    step(&self.nodes, &mut m[l], &k[l]);
                }
            }
            for (n, m) in n.iter_mut().zip(m) {
                *n = m as u32;
            }
        }
        for (n, k) in lanes.into_remainder().iter_mut().zip(ks.remainder()) {
            let mut m = 0;
            for _ in 0..self.depth {
                step(&self.nodes, &mut m, k);
            }
            *n = m as u32;
        }
    }
}

/// The split that best balances the rules of a region: over every field and every rule
/// boundary inside the region, the threshold minimising the larger side (then the total,
/// which counts replication). `None` when no split makes both sides smaller.
fn best_split<const N: usize>(rules: &[(u32, Rule<N>)], job: &Job<N>) -> Option<(u8, u32)> {
    let n = job.rules.len();
    let mut best: Option<(usize, usize, u8, u32)> = None;
    let mut los = Vec::with_capacity(n);
    let mut his = Vec::with_capacity(n);
    for f in 0..N {
        los.clear();
        his.clear();
        for &i in &job.rules {
            let r = &rules[i as usize].1;
            los.push(r.lo[f].max(job.lo[f]));
            his.push(r.hi[f].min(job.hi[f]));
        }
        // A field every rule leaves open over the region has no threshold to offer (the
        // low words of IPv6 prefixes, mostly): skip the sorting.
        if his.iter().all(|&h| h >= job.hi[f]) {
            continue;
        }
        los.sort_unstable();
        his.sort_unstable();
        // Candidate thresholds: each rule's upper end inside the region. Rules left of t
        // are those starting at or below t; right, those ending above t.
        let mut j = 0;
        let mut k = 0;
        let mut last = None;
        for &t in &his {
            if t >= job.hi[f] || last == Some(t) {
                continue;
            }
            last = Some(t);
            while j < n && los[j] <= t {
                j += 1;
            }
            while k < n && his[k] <= t {
                k += 1;
            }
            let (left, right) = (j, n - k);
            let (worst, total) = (left.max(right), left + right);
            if worst < n && best.is_none_or(|(w, s, _, _)| (worst, total) < (w, s)) {
                best = Some((worst, total, f as u8, t));
            }
        }
    }
    best.map(|(_, _, f, t)| (f, t))
}

/// A rule's group: which of the grouping fields (those with `open_bits`, at most four)
/// it leaves open. Rules open on the same fields build small trees together.
fn group<const N: usize>(r: &Rule<N>, space: &Space<N>) -> usize {
    (0..N)
        .filter(|&f| space.open_bits[f] != 0)
        .take(4)
        .enumerate()
        .filter(|&(_, f)| free_bits(r, f, space) >= u32::from(space.open_bits[f]))
        .map(|(bit, _)| 1 << bit)
        .sum()
}

/// How many low bits of field `f` (from its first word over its span) the rule leaves
/// free: those of its first word that is not a single value, and all words after it. A
/// range of `d + 1` values frees floor(log2(d + 1)) bits, so a one-word field is open from
/// `2^open_bits` values, whether or not the range is a prefix.
fn free_bits<const N: usize>(r: &Rule<N>, f: usize, space: &Space<N>) -> u32 {
    let span = usize::from(space.span[f].max(1));
    (f..(f + span).min(N))
        .find(|&w| r.hi[w] > r.lo[w])
        .map_or(0, |w| {
            let d = r.hi[w] - r.lo[w];
            let bits = d.checked_add(1).map_or(32, |n| 31 - n.leading_zeros());
            bits + 32 * (f + span - 1 - w) as u32
        })
}

/// What lookups read, built once per rebuild and shared by every reader.
#[derive(Debug)]
struct Built<const N: usize> {
    /// (best priority in the tree, tree), best first.
    trees: Vec<(u32, Tree<N>)>,
    /// Sorted (covering rule, hidden rule) pairs of every tree (see `Tree::covering`).
    covering: Vec<(u32, u32)>,
    /// The same pairs the other way round, (hidden rule, covering rule), sorted.
    hidden_by: Vec<(u32, u32)>,
    /// The rules as the trees were built over them, by id.
    rules: Vec<Option<Rule<N>>>,
    /// Bit per rule id: deleted since the trees were built. Writers flip bits with atomic
    /// operations, so deletions and revivals need no new snapshot.
    dead: Box<[AtomicU64]>,
}

impl<const N: usize> Built<N> {
    /// The first live rule of the trees that matches each key of a batch: `out[i]` for
    /// `keys[i]`, the trees descended for many keys at once (see `Tree::lookup_batch`).
    /// A tree is descended only by the keys it could give a better rule than they have:
    /// after the first tree most keys of a rule set usually have theirs.
    fn classify_batch(&self, keys: &[Key<N>], out: &mut [Option<u32>]) {
        let mut at = [0u32; CHUNK];
        let mut padded = [[0u32; 16]; CHUNK];
        // The keys a later tree is descended by, and where each is in the chunk.
        let mut needy = [[0u32; 16]; CHUNK];
        let mut need = [0u8; CHUNK];
        for (keys, out) in keys.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
            let n = keys.len();
            for (p, k) in padded.iter_mut().zip(keys) {
                p[..N].copy_from_slice(&k.0);
            }
            out.fill(None);
            for (t, (best, tree)) in self.trees.iter().enumerate() {
                let (descending, which): (&[[u32; 16]], &[u8]) = if t == 0 {
                    (&padded[..n], &EVERY_KEY[..n])
                } else {
                    let mut m = 0;
                    for (i, o) in out.iter().enumerate() {
                        need[m] = i as u8;
                        needy[m] = padded[i];
                        m += usize::from(!o.is_some_and(|f| f < *best));
                    }
                    (&needy[..m], &need[..m])
                };
                // The trees come best first: none after this one has a better rule either.
                if which.is_empty() {
                    break;
                }
                let m = which.len();
                tree.lookup_batch(descending, &mut at[..m]);
                tree.prefetch_leaves(&at[..m]);
                for (&w, &leaf) in which.iter().zip(&at[..m]) {
                    let i = usize::from(w);
                    if let Some(id) = tree.scan(leaf as usize, &keys[i], &self.dead) {
                        out[i] = Some(out[i].map_or(id, |f| f.min(id)));
                    }
                }
            }
        }
    }

    /// The first live rule of the trees that matches.
    #[inline]
    fn classify(&self, k: &Key<N>) -> Option<u32> {
        let mut found: Option<u32> = None;
        for (best, tree) in &self.trees {
            if found.is_some_and(|f| f < *best) {
                break;
            }
            if let Some(id) = tree.lookup(k, &self.dead) {
                found = Some(found.map_or(id, |f| f.min(id)));
            }
        }
        found
    }
}

/// Trees over rules that never change (a pipe of a loaded pipeline): lookups skip the
/// snapshot loads a [`Classifier`] makes to allow concurrent updates.
#[derive(Debug)]
pub struct FixedClassifier<const N: usize>(Built<N>);

impl<const N: usize> FixedClassifier<N> {
    pub fn new(space: Space<N>, rules: &[Rule<N>]) -> FixedClassifier<N> {
        let all: Vec<Option<Rule<N>>> = rules.iter().copied().map(Some).collect();
        FixedClassifier(build(&all, &space))
    }

    /// The priority (index) of the first rule that matches.
    #[inline]
    pub fn classify(&self, k: &Key<N>) -> Option<u32> {
        self.0.classify(k)
    }

    /// [`FixedClassifier::classify`] for each key of a batch: `out[i]` for `keys[i]`.
    pub fn classify_batch(&self, keys: &[Key<N>], out: &mut [Option<u32>]) {
        self.0.classify_batch(keys, out);
    }
}

/// Rules by priority (their index), trees over them, and the updates since they were
/// built. Lookups (`&self`, any number of threads) never wait for a writer: they load one
/// immutable snapshot, the trees with the list of rules added beside them, swapped
/// atomically (`ArcSwap`), so a rebuild that folds the list into new trees is seen whole
/// or not at all. A deletion or a revival is one atomic bit flip in the trees; a new or
/// replaced rule publishes a new list in one step. Writers take turns on a mutex.
#[derive(Debug)]
pub struct Classifier<const N: usize = FIELDS> {
    space: Space<N>,
    /// Shared with the rebuild running in the background, if any, as are the others.
    view: Arc<ArcSwap<View<N>>>,
    /// The current rules; its lock orders the writers (and a rebuild's publication).
    writer: Arc<Mutex<Writer<N>>>,
    /// Signalled whenever a background rebuild publishes.
    rebuilt: Arc<Condvar>,
}

/// What writers keep under their lock.
#[derive(Debug)]
struct Writer<const N: usize> {
    /// The current rules by id.
    rules: Vec<Option<Rule<N>>>,
    /// A rebuild is running in the background.
    rebuilding: bool,
}

fn lock_writer<const N: usize>(m: &Mutex<Writer<N>>) -> MutexGuard<'_, Writer<N>> {
    // A writer that panicked left the rules as they were: carry on with them.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a lookup reads: the trees and the rules added beside them since they were built
/// (checked linearly; sorted by id).
#[derive(Debug)]
struct View<const N: usize> {
    built: Arc<Built<N>>,
    added: Vec<(u32, Rule<N>)>,
}

impl<const N: usize> View<N> {
    /// Trees over all of `rules`, nothing beside them.
    fn built_from(rules: &[Option<Rule<N>>], space: &Space<N>) -> Arc<View<N>> {
        Arc::new(View {
            built: Arc::new(build(rules, space)),
            added: Vec::new(),
        })
    }

    /// The first rule that matches, of the list's rules ahead of `found` (a match
    /// already in hand): the list is in priority order, so the scan stops where it
    /// could no longer better `found`, and rules added after a set's own (a common case)
    /// cost keys the trees matched nothing.
    #[inline]
    fn best_of_added(&self, k: &Key<N>, found: Option<u32>) -> Option<u32> {
        let ahead = found.map_or(self.added.len(), |f| {
            self.added.partition_point(|(id, _)| *id < f)
        });
        self.added[..ahead]
            .iter()
            .find(|(_, r)| r.matches(k))
            .map_or(found, |(id, _)| Some(*id))
    }
}

#[inline]
fn is_dead(dead: &[AtomicU64], id: u32) -> bool {
    dead.get(id as usize / 64)
        .is_some_and(|w| w.load(Ordering::Relaxed) >> (id % 64) & 1 == 1)
}

/// Puts `(id, rule)` in a list sorted by id, replacing the entry of `id` if any.
fn put_sorted<const N: usize>(list: &mut Vec<(u32, Rule<N>)>, id: u32, rule: Rule<N>) {
    let at = list.partition_point(|(p, _)| *p < id);
    match list.get_mut(at) {
        Some(e) if e.0 == id => e.1 = rule,
        _ => list.insert(at, (id, rule)),
    }
}

impl Classifier {
    /// A 5-tuple classifier over `rules`; a rule's priority is its index (0 first).
    pub fn new(rules: &[Rule]) -> Classifier {
        Classifier::with_space(FIVE_TUPLE, rules)
    }
}

impl<const N: usize> Classifier<N> {
    /// A classifier over the fields `space` describes.
    pub fn with_space(space: Space<N>, rules: &[Rule<N>]) -> Classifier<N> {
        let all: Vec<Option<Rule<N>>> = rules.iter().copied().map(Some).collect();
        Classifier {
            view: Arc::new(ArcSwap::new(View::built_from(&all, &space))),
            space,
            writer: Arc::new(Mutex::new(Writer {
                rules: all,
                rebuilding: false,
            })),
            rebuilt: Arc::new(Condvar::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Writer<N>> {
        lock_writer(&self.writer)
    }

    /// Folds every update into new trees, here and now (after any rebuild running in the
    /// background).
    pub fn rebuild(&self) {
        let mut w = self.lock();
        while w.rebuilding {
            w = self.rebuilt.wait(w).unwrap_or_else(|e| e.into_inner());
        }
        self.view.store(View::built_from(&w.rules, &self.space));
    }

    /// After a write that left `listed` rules in the list: starts a rebuild in the
    /// background once the list outgrows `MAX_ADDED` (the writer goes on), and past
    /// `MAX_PENDING` waits for it, so the list lookups scan stays short.
    fn settle(&self, mut w: MutexGuard<'_, Writer<N>>, mut listed: usize) {
        loop {
            if listed > MAX_ADDED && !w.rebuilding {
                self.start_rebuild(&mut w);
            }
            if !(w.rebuilding && listed > MAX_PENDING) {
                return;
            }
            // A rebuild that ends with the list still long leaves the next to this writer.
            w = self.rebuilt.wait(w).unwrap_or_else(|e| e.into_inner());
            listed = self.view.load().added.len();
        }
    }

    /// Starts a rebuild of the rules `w` holds in a thread of its own (here, if no thread
    /// can be had).
    fn start_rebuild(&self, w: &mut Writer<N>) {
        w.rebuilding = true;
        let job = Rebuild {
            space: self.space,
            view: Arc::clone(&self.view),
            writer: Arc::clone(&self.writer),
            rebuilt: Arc::clone(&self.rebuilt),
        };
        let snapshot = w.rules.clone();
        let spawned = std::thread::Builder::new()
            .name("acl-rebuild".into())
            .spawn(move || job.run(snapshot));
        if spawned.is_err() {
            self.view.store(View::built_from(&w.rules, &self.space));
            w.rebuilding = false;
        }
    }

    /// Number of live rules.
    pub fn len(&self) -> usize {
        self.lock().rules.iter().filter(|r| r.is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Updates waiting for [`Classifier::rebuild`].
    pub fn pending_updates(&self) -> usize {
        let view = self.view.load();
        let dead: usize = view
            .built
            .dead
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
            .sum();
        view.added.len() + dead
    }

    /// Bytes of lookup structure.
    pub fn memory_bytes(&self) -> usize {
        let view = self.view.load();
        let b = &view.built;
        let trees: usize = b
            .trees
            .iter()
            .map(|(_, t)| {
                t.nodes.len() * (size_of::<Node>() + size_of::<(u32, u32)>())
                    + t.leaf.len() * size_of::<LeafRule<N>>()
                    + t.tests.len() * size_of::<[Masked; 2]>()
            })
            .sum();
        trees + b.dead.len() * 8
    }

    /// Publishes the list of `view` (the current snapshot, which the writer's lock keeps
    /// current) with `f` applied, beside the same trees, in one step: its length.
    fn edit_added(&self, view: &View<N>, f: impl FnOnce(&mut Vec<(u32, Rule<N>)>)) -> usize {
        let mut added = view.added.clone();
        f(&mut added);
        let listed = added.len();
        self.view.store(Arc::new(View {
            built: Arc::clone(&view.built),
            added,
        }));
        listed
    }

    /// Sets the rule of priority `id`, replacing any: a reader finds the old rule or the
    /// new one at every moment, never neither. A rule the trees already hold (deleted,
    /// now back) is revived in place; others go in the list beside the trees, folded in
    /// by a rebuild once it grows past `MAX_ADDED`.
    pub fn insert(&self, id: u32, rule: Rule<N>) {
        let mut w = self.lock();
        let i = id as usize;
        if i >= w.rules.len() {
            w.rules.resize(i + 1, None);
        }
        // The snapshot's guard, not a new reference: a count bumped per update would sit
        // in the cache line the readers read the trees from.
        let view = self.view.load();
        let built = &view.built;
        let mut listed = view.added.len();
        let old = w.rules[i].replace(rule);
        let as_built = built.rules.get(i).copied().flatten();
        if as_built == Some(rule) {
            // The trees hold the rule again, except in regions a rule covering them hid
            // it from: if such a rule is dead now, the rule goes in the list too. It
            // comes alive in the trees first and leaves the list (where an older rule of
            // the id may be) after, so readers find one or the other throughout.
            let from = built.hidden_by.partition_point(|(h, _)| *h < id);
            let uncovered = built.hidden_by[from..]
                .iter()
                .take_while(|(h, _)| *h == id)
                .any(|&(_, c)| is_dead(&built.dead, c));
            built.dead[i / 64].fetch_and(!(1 << (i % 64)), Ordering::Release);
            let in_list = view.added.iter().any(|(p, _)| *p == id);
            if uncovered || in_list {
                listed = self.edit_added(&view, |l| {
                    if uncovered {
                        put_sorted(l, id, rule);
                    } else {
                        l.retain(|(p, _)| *p != id);
                    }
                });
            }
        } else {
            // The new rule replaces the id's entry in the list, with, when the trees'
            // rule of the id is the one going, the rules it hid there; that rule dies
            // after.
            let hidden = if old.is_some() && old == as_built {
                hidden_by(built, &w.rules, id)
            } else {
                Vec::new()
            };
            listed = self.edit_added(&view, |l| {
                put_sorted(l, id, rule);
                for (h, r) in hidden {
                    put_sorted(l, h, r);
                }
            });
            if as_built.is_some() {
                built.dead[i / 64].fetch_or(1 << (i % 64), Ordering::Release);
            }
        }
        drop(view);
        self.settle(w, listed);
    }

    /// Removes the rule of priority `id`; false if there was none.
    pub fn remove(&self, id: u32) -> bool {
        let mut w = self.lock();
        let i = id as usize;
        let Some(old) = w.rules.get_mut(i).and_then(Option::take) else {
            return false;
        };
        let view = self.view.load();
        let built = &view.built;
        let mut listed = view.added.len();
        let in_list = view.added.iter().any(|(p, _)| *p == id);
        // Where the trees hold it, rules it hid are missing from some leaves: they join
        // the list (harmless where the trees hold them too: the best priority wins)
        // before the rule dies, so no reader misses them.
        let in_trees = built.rules.get(i).copied().flatten() == Some(old);
        let hidden = if in_trees {
            hidden_by(built, &w.rules, id)
        } else {
            Vec::new()
        };
        if in_list || !hidden.is_empty() {
            listed = self.edit_added(&view, |l| {
                l.retain(|(p, _)| *p != id);
                for (h, r) in hidden {
                    put_sorted(l, h, r);
                }
            });
        }
        if in_trees {
            built.dead[i / 64].fetch_or(1 << (i % 64), Ordering::Release);
        }
        drop(view);
        self.settle(w, listed);
        true
    }

    /// Rules that hide others in some region of the trees.
    pub fn covering_rules(&self) -> usize {
        let view = self.view.load();
        let mut ids: Vec<u32> = view.built.covering.iter().map(|(c, _)| *c).collect();
        ids.dedup();
        ids.len()
    }

    /// Number of trees (rule groups).
    pub fn trees(&self) -> usize {
        self.view.load().built.trees.len()
    }

    /// Per tree: (depth, nodes, rule copies in leaves).
    pub fn tree_shapes(&self) -> Vec<(usize, usize, usize)> {
        self.view
            .load()
            .built
            .trees
            .iter()
            .map(|(_, t)| (t.depth, t.nodes.len(), t.leaf.len()))
            .collect()
    }

    /// The priority (index) of the first rule that matches.
    #[inline]
    pub fn classify(&self, k: &Key<N>) -> Option<u32> {
        let mut found = None;
        self.read(|view| found = view.best_of_added(k, view.built.classify(k)));
        found
    }

    /// Classifies a batch of keys; `out[i]` is the answer for `keys[i]`. The trees are
    /// descended for the whole batch at once (see `Tree::lookup_batch`).
    pub fn classify_batch(&self, keys: &[Key<N>], out: &mut [Option<u32>]) {
        self.read(|view| {
            view.built.classify_batch(keys, out);
            if !view.added.is_empty() {
                for (k, o) in keys.iter().zip(out.iter_mut()) {
                    *o = view.best_of_added(k, *o);
                }
            }
        });
    }

    /// Runs `lookup` on the current snapshot until no writer published another while it
    /// ran. The trees' dead bits are shared by every snapshot of the same trees, and a
    /// writer flips one (with release ordering) only after publishing what makes up for
    /// it (a replacement, the rules a deleted one hid): a lookup that saw the bit sees,
    /// after its acquire fence, that its snapshot is no longer current, and looks again.
    /// Bit flips alone (deletions, revivals) publish nothing and retry nothing.
    #[inline]
    fn read(&self, mut lookup: impl FnMut(&View<N>)) {
        loop {
            let view = self.view.load();
            lookup(&view);
            fence(Ordering::Acquire);
            if std::ptr::eq(&**view, &**self.view.load()) {
                return;
            }
        }
    }
}

/// The live `rules` that the trees' rule `id` hides in some of their regions.
fn hidden_by<const N: usize>(
    built: &Built<N>,
    rules: &[Option<Rule<N>>],
    id: u32,
) -> Vec<(u32, Rule<N>)> {
    let from = built.covering.partition_point(|(c, _)| *c < id);
    built.covering[from..]
        .iter()
        .take_while(|(c, _)| *c == id)
        .filter_map(|&(_, h)| rules.get(h as usize).copied().flatten().map(|r| (h, r)))
        .collect()
}

/// A rebuild in the background: trees built from a snapshot of the rules, without the
/// writers' lock; then, under it, the changes made meanwhile applied to them as updates
/// (rules changed or gone die in the new trees, and with the rules they hid, rules new or
/// changed are listed beside them) and the whole published in one step.
struct Rebuild<const N: usize> {
    space: Space<N>,
    view: Arc<ArcSwap<View<N>>>,
    writer: Arc<Mutex<Writer<N>>>,
    rebuilt: Arc<Condvar>,
}

impl<const N: usize> Rebuild<N> {
    fn run(self, mut snapshot: Vec<Option<Rule<N>>>) {
        // However this ends, writers stop waiting for it.
        let finished = Finished(&self);
        loop {
            let built = build(&snapshot, &self.space);
            let w = lock_writer(&self.writer);
            let added = catch_up(&snapshot, &w.rules, &built);
            let again = added.len() > MAX_ADDED;
            self.view.store(Arc::new(View {
                built: Arc::new(built),
                added,
            }));
            self.rebuilt.notify_all();
            if !again {
                drop(w);
                drop(finished);
                return;
            }
            snapshot = w.rules.clone();
        }
    }
}

/// Marks a [`Rebuild`] over when dropped (on return or on a panic).
struct Finished<'a, const N: usize>(&'a Rebuild<N>);

impl<const N: usize> Drop for Finished<'_, N> {
    fn drop(&mut self) {
        lock_writer(&self.0.writer).rebuilding = false;
        self.0.rebuilt.notify_all();
    }
}

/// The list to publish beside trees `built` from the rules `then`, now that the rules
/// are `now`: the rules of `now` the trees lack or hold otherwise, and those the rules
/// that changed hid in the trees. The changed rules die in `built` (no reader has it yet).
fn catch_up<const N: usize>(
    then: &[Option<Rule<N>>],
    now: &[Option<Rule<N>>],
    built: &Built<N>,
) -> Vec<(u32, Rule<N>)> {
    let mut added = Vec::new();
    for i in 0..then.len().max(now.len()) {
        let (was, is) = (
            then.get(i).copied().flatten(),
            now.get(i).copied().flatten(),
        );
        if was == is {
            continue;
        }
        let id = i as u32;
        if was.is_some() {
            built.dead[i / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
            for (h, r) in hidden_by(built, now, id) {
                put_sorted(&mut added, h, r);
            }
        }
        if let Some(r) = is {
            put_sorted(&mut added, id, r);
        }
    }
    added
}

/// Trees over the live `rules`: one per group, then groups merged while the merged tree
/// stays small (fewer trees make faster lookups, as long as rules are not copied much more).
fn build<const N: usize>(rules: &[Option<Rule<N>>], space: &Space<N>) -> Built<N> {
    let mut groups: Vec<Vec<(u32, Rule<N>)>> = vec![Vec::new(); 16];
    for (i, r) in rules.iter().enumerate() {
        if let Some(r) = r {
            groups[group(r, space)].push((i as u32, *r));
        }
    }
    let mut parts: Vec<(Vec<(u32, Rule<N>)>, Tree<N>)> = groups
        .into_iter()
        .filter(|g| !g.is_empty())
        .filter_map(|g| Tree::build(&g, usize::MAX, space.max).map(|t| (g, t)))
        .collect();
    parts.sort_by_key(|(g, _)| std::cmp::Reverse(g.len()));
    let mut merged: Vec<(Vec<(u32, Rule<N>)>, Tree<N>)> = Vec::new();
    for (g, t) in parts {
        let target = merged.iter().enumerate().find_map(|(i, (mg, mt))| {
            // Up to half again as many rule copies, plus a little; for sets of up to 4096
            // rules plus a lot: one tree is worth a few hundred KiB of copies (the 1k
            // ClassBench sets become one tree, 1.5-2.4x faster lookups), while larger sets
            // would pay for it in build time.
            let slack = if mg.len() + g.len() <= 4096 {
                4096
            } else {
                256
            };
            let budget = (mt.leaf.len() + t.leaf.len()) * 3 / 2 + slack;
            let mut all: Vec<(u32, Rule<N>)> = mg.iter().chain(&g).copied().collect();
            all.sort_unstable_by_key(|(id, _)| *id);
            Tree::build(&all, budget, space.max).map(|tree| (i, all, tree))
        });
        match target {
            Some((i, all, tree)) => merged[i] = (all, tree),
            None => merged.push((g, t)),
        }
    }
    let mut trees: Vec<(u32, Tree<N>)> = merged.into_iter().map(|(g, t)| (g[0].0, t)).collect();
    trees.sort_by_key(|(best, _)| *best);
    let mut covering: Vec<(u32, u32)> = trees
        .iter()
        .flat_map(|(_, t)| t.covering.iter().copied())
        .collect();
    covering.sort_unstable();
    let mut hidden_by: Vec<(u32, u32)> = covering.iter().map(|&(c, h)| (h, c)).collect();
    hidden_by.sort_unstable();
    Built {
        trees,
        covering,
        hidden_by,
        rules: rules.to_vec(),
        dead: (0..rules.len().div_ceil(64))
            .map(|_| AtomicU64::new(0))
            .collect(),
    }
}

/// Reads a ClassBench rule file; errors name the file and line.
pub fn load_rules(path: &std::path::Path) -> Result<Vec<Rule>, String> {
    read_lines(path, |l| {
        crate::lang::classbench::parse_line(l)
            .map(|r| Rule::from(&r))
            .map_err(|e| e.to_string())
    })
}

/// One trace line: `SRC DST SPORT DPORT PROTO` as integers (decimal or 0x-hexadecimal),
/// as `dpdk-test-acl` reads them.
fn parse_trace(line: &str) -> Option<Key> {
    let t: Vec<&str> = line.split_whitespace().collect();
    let [s, d, sp, dp, p] = t[..] else {
        return None;
    };
    Some(Key([
        integer_upto(s, u32::MAX)?,
        integer_upto(d, u32::MAX)?,
        integer_upto(sp, 65535)?,
        integer_upto(dp, 65535)?,
        integer_upto(p, 255)?,
    ]))
}

/// Reads a trace (see `parse_trace`).
pub fn load_trace(path: &std::path::Path) -> Result<Vec<Key>, String> {
    read_lines(path, |l| {
        parse_trace(l).ok_or_else(|| TRACE_FORMAT.to_owned())
    })
}

/// A small deterministic generator (SplitMix64), so traces are reproducible from a seed.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u32, hi: u32) -> u32 {
        let span = u64::from(hi - lo) + 1;
        lo + (self.next_u64() % span) as u32
    }
}

/// `count` packets: nine in ten drawn inside a random rule's ranges, the rest uniform.
pub fn gen_trace(rules: &[Rule], count: usize, seed: u64) -> Vec<Key> {
    let mut rng = SplitMix(seed);
    (0..count)
        .map(|_| {
            if rules.is_empty() || rng.next_u64() % 10 == 0 {
                let max = [u32::MAX, u32::MAX, 65535, 65535, 255];
                Key(std::array::from_fn(|f| rng.range(0, max[f])))
            } else {
                let r = &rules[(rng.next_u64() % rules.len() as u64) as usize];
                let mut k = Key(std::array::from_fn(|f| rng.range(r.lo[f], r.hi[f])));
                for m in r.masked.iter().filter(|m| m.mask != 0) {
                    let f = usize::from(m.field);
                    k.0[f] = m.value | (k.0[f] & !m.mask);
                }
                k
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One update, to the classifier and to the model: `Some(rule)` inserts it at `id`,
    /// `None` removes the rule there (the classifier saying whether it had one).
    fn update(
        c: &Classifier,
        model: &mut Vec<Option<Rule>>,
        id: u32,
        rule: Option<Rule>,
    ) -> Result<(), TestCaseError> {
        let i = id as usize;
        match rule {
            Some(r) => {
                c.insert(id, r);
                if model.len() <= i {
                    model.resize(i + 1, None);
                }
                model[i] = Some(r);
            }
            None => {
                let had = model.get(i).copied().flatten().is_some();
                prop_assert_eq!(c.remove(id), had);
                model.get_mut(i).map(Option::take);
            }
        }
        Ok(())
    }

    fn linear(rules: &[Option<Rule>], k: &Key) -> Option<u32> {
        rules
            .iter()
            .position(|r| r.is_some_and(|r| r.matches(k)))
            .map(|i| i as u32)
    }

    /// Rules with heavy overlap: nested prefixes, overlapping ranges, wildcards.
    fn rule() -> impl Strategy<Value = Rule> {
        let prefix = (
            0u32..4,
            prop_oneof![Just(0u8), Just(8), Just(16), Just(24), Just(30), Just(32)],
        )
            .prop_map(|(a, len)| {
                let (lo, hi) = prefix_range(0x0a00_0000 | (a << 8) | a, len);
                (lo, hi)
            });
        let ports = prop_oneof![
            Just((0u32, 65535u32)),
            (0u32..100, 0u32..100).prop_map(|(a, b)| (a.min(b), a.max(b))),
            (0u32..100).prop_map(|p| (p, p))
        ];
        let proto = prop_oneof![
            Just((0u8, 0u8)),
            Just((6, 0xff)),
            Just((17, 0xff)),
            Just((0x04, 0x0c))
        ];
        (prefix.clone(), prefix, ports.clone(), ports, proto).prop_map(
            |(s, d, sp, dp, (pv, pm))| {
                let (p0, p1) = if pm == 0xff {
                    (u32::from(pv), u32::from(pv))
                } else {
                    (0, 255)
                };
                let mut masked = [Masked::default(); 2];
                if pm != 0 && pm != 0xff {
                    masked[0] = Masked {
                        field: 4,
                        value: u32::from(pv),
                        mask: u32::from(pm),
                    };
                }
                Rule {
                    lo: [s.0, d.0, sp.0, dp.0, p0],
                    hi: [s.1, d.1, sp.1, dp.1, p1],
                    masked,
                }
            },
        )
    }

    fn key() -> impl Strategy<Value = Key> {
        (
            0u32..4,
            0u32..4,
            0u16..110,
            0u16..110,
            prop_oneof![Just(6u8), Just(17), Just(1), Just(4), Just(7)],
        )
            .prop_map(|(s, d, sp, dp, p)| {
                Key::new(
                    0x0a00_0000 | (s << 8) | s,
                    0x0a00_0000 | (d << 8) | d,
                    sp,
                    dp,
                    p,
                )
            })
    }

    /// Readers running while a writer deletes and re-inserts a rule always see the rule
    /// set either with it or without it.
    #[test]
    fn readers_see_consistent_answers_during_updates() {
        let rules: Vec<Rule> = (0..200u32)
            .map(|i| {
                let (s0, s1) = prefix_range(0x0a00_0000 | (i % 7) << 8, 24 - (i % 3) as u8 * 8);
                Rule {
                    lo: [s0, 0, 0, i % 50, 0],
                    hi: [s1, u32::MAX, 65535, 65535, 255],
                    masked: Default::default(),
                }
            })
            .collect();
        let c = Classifier::new(&rules);
        let keys: Vec<Key> = (0..64u32)
            .map(|i| Key::new(0x0a00_0000 | (i % 7) << 8 | i, 1, 2, (i * 3) as u16, 6))
            .collect();
        let all: Vec<Option<Rule>> = rules.iter().copied().map(Some).collect();
        let toggled = 3u32;
        let mut without = all.clone();
        without[toggled as usize] = None;
        let allowed: Vec<[Option<u32>; 2]> = keys
            .iter()
            .map(|k| [linear(&all, k), linear(&without, k)])
            .collect();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..20_000 {
                    c.remove(toggled);
                    c.insert(toggled, rules[toggled as usize]);
                }
                done.store(true, Ordering::Relaxed);
            });
            let mut out = vec![None; keys.len()];
            while !done.load(Ordering::Relaxed) {
                c.classify_batch(&keys, &mut out);
                for (o, ok) in out.iter().zip(&allowed) {
                    assert!(ok.contains(o), "{o:?} not in {ok:?}");
                }
            }
        });
    }

    /// Neither a replacement nor a rebuild that folds the rules added beside the trees
    /// into new ones hides a rule from a reader at any moment: one rule, replaced again
    /// and again by a new one that matches the same keys (so each goes in beside the
    /// trees), is always what a key only it matches finds, while rules new to the trees
    /// keep filling the list past `MAX_ADDED` (a rebuild every few rounds).
    #[test]
    fn replacements_and_rebuilds_hide_no_rule_from_readers() {
        let only = |port: u32| Rule {
            lo: [0x0b00_0000, 0, 0, port, 0],
            hi: [0x0b00_0000, u32::MAX, 65535, port, 255],
            masked: Default::default(),
        };
        let base: Vec<Rule> = (0..100u32).map(|i| only(1000 + i)).collect();
        let c = Classifier::new(&base);
        let id = 50u32;
        let key = Key::new(0x0b00_0000, 1, 2, 7, 6);
        c.insert(id, only(7));
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                for round in 0..400u32 {
                    for extra in 0..40 {
                        let n = round * 40 + extra;
                        c.insert(200 + n % 2000, only(3000 + n % 20_000));
                    }
                    let hi = [0x0b00_0000, u32::MAX - round % 2, 65535, 7, 255];
                    c.insert(id, Rule { hi, ..only(7) });
                }
                done.store(true, Ordering::Relaxed);
            });
            let mut out = [None];
            while !done.load(Ordering::Relaxed) {
                assert_eq!(c.classify(&key), Some(id));
                c.classify_batch(std::slice::from_ref(&key), &mut out);
                assert_eq!(out[0], Some(id));
            }
        });
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        /// Long runs of updates, most of them rules new to the trees, so the list
        /// outgrows its bound again and again and rebuilds run in the background while
        /// the updates go on: every answer, after every update, is a linear scan's. Each
        /// rule matches one of the keys exactly, so most updates change some key's answer
        /// (rules matching much would hide the changes behind the first few ids).
        #[test]
        fn agrees_through_background_rebuilds(
            keys in proptest::collection::vec(key(), 8),
            base in proptest::collection::vec(0usize..8, 0..60),
            updates in proptest::collection::vec((0u8..4, 0u32..400, 0usize..8, 0u8..3), 500..1000),
        ) {
            // The rule that matches `keys[k]` alone, with any protocol (`wide` 1), or with
            // anything but its source (`wide` 2: such rules cover whole regions of the
            // trees and hide the others there).
            let exact = |k: usize, wide: u8| {
                let f = keys[k].0;
                let mut r = Rule { lo: f, hi: f, masked: Default::default() };
                if wide > 0 {
                    (r.lo[4], r.hi[4]) = (0, 255);
                }
                if wide > 1 {
                    r.lo[1..4].copy_from_slice(&[0, 0, 0]);
                    r.hi[1..4].copy_from_slice(&[u32::MAX, 65535, 65535]);
                }
                r
            };
            let rules: Vec<Rule> = base.iter().map(|&k| exact(k, 0)).collect();
            let c = Classifier::new(&rules);
            let mut model: Vec<Option<Rule>> = rules.iter().copied().map(Some).collect();
            for (op, id, k, wide) in updates {
                update(&c, &mut model, id, (op > 0).then(|| exact(k, wide)))?;
                for k in &keys {
                    prop_assert_eq!(c.classify(k), linear(&model, k));
                }
            }
            c.rebuild();
            prop_assert_eq!(c.pending_updates(), 0);
            let mut out = vec![None; keys.len()];
            c.classify_batch(&keys, &mut out);
            let want: Vec<Option<u32>> = keys.iter().map(|k| linear(&model, k)).collect();
            prop_assert_eq!(out, want);
        }
    }

    proptest! {
        /// A background rebuild's catching up: trees built from the rules as they were,
        /// with the changes made since applied by `catch_up`, answer as the rules are
        /// now, among them the rules a changed one hid in the trees.
        #[test]
        fn trees_caught_up_answer_as_the_rules_now_are(
            rules in proptest::collection::vec(rule(), 1..80),
            changes in proptest::collection::vec((0u32..100, proptest::option::of(rule())), 1..30),
            keys in proptest::collection::vec(key(), 1..60),
        ) {
            let then: Vec<Option<Rule>> = rules.iter().copied().map(Some).collect();
            let mut now = then.clone();
            for (id, r) in changes {
                if now.len() <= id as usize { now.resize(id as usize + 1, None); }
                now[id as usize] = r;
            }
            let built = build(&then, &FIVE_TUPLE);
            let added = catch_up(&then, &now, &built);
            let view = View { built: Arc::new(built), added };
            for k in &keys {
                prop_assert_eq!(view.best_of_added(k, view.built.classify(k)), linear(&now, k));
            }
        }
    }

    proptest! {
        /// Any IPv6 rule line, written with any blanks, reads back as its prefixes' and
        /// ranges' bounds (a port range given high end first is refused); any line at all
        /// reads or fails, never panics; trace lines read back as their words.
        #[test]
        fn ipv6_lines_read_back(
            (src, slen, dst, dlen) in (any::<u128>(), 0u32..=128, any::<u128>(), 0u32..=128),
            ports in [any::<u16>(); 4],
            gap in proptest::sample::select(vec![" ", "\t", " \t "]),
            junk in "[@0-9a-fA-FxX./: \t]{0,80}",
        ) {
            let line = format!(
                "@{}/{slen}{gap}{}/{dlen}{gap}{} : {}{gap}{} : {}{gap}6/0xff",
                std::net::Ipv6Addr::from(src), std::net::Ipv6Addr::from(dst),
                ports[0], ports[1], ports[2], ports[3],
            );
            let host = |len: u32| u128::MAX.checked_shr(len).unwrap_or(0);
            let read = rule_v6(&line);
            if ports[0] > ports[1] || ports[2] > ports[3] {
                prop_assert!(read.unwrap_err().contains("is empty"));
            } else {
                let r = read.unwrap();
                prop_assert_eq!(&r.lo[..4], &words(src & !host(slen)));
                prop_assert_eq!(&r.hi[..4], &words(src | host(slen)));
                prop_assert_eq!(&r.lo[4..8], &words(dst & !host(dlen)));
                prop_assert_eq!(&r.hi[4..8], &words(dst | host(dlen)));
                prop_assert_eq!([r.lo[8], r.hi[8], r.lo[9], r.hi[9]], ports.map(u32::from));
            }
            let _ = rule_v6(&junk);
            let trace = format!("{}{gap}{}{gap}{}{gap}{}{gap}17", std::net::Ipv6Addr::from(src), std::net::Ipv6Addr::from(dst), ports[0], ports[1]);
            let k = parse_trace_v6(&trace).unwrap();
            prop_assert_eq!(&k.0[..4], &words(src));
            prop_assert_eq!(&k.0[8..], &[u32::from(ports[0]), u32::from(ports[1]), 17]);
            let _ = (parse_trace_v6(&junk), parse_trace(&junk));
        }
    }

    proptest! {
        /// A tree capped at a few levels still answers as a linear scan, and its leaves
        /// are no longer than the cap allows (or than the leaves no split shortens).
        #[test]
        fn capped_trees_agree_and_keep_leaves_short(rules in proptest::collection::vec(rule(), 1..150), keys in proptest::collection::vec(key(), 1..60), cap in 0usize..4) {
            let ids: Vec<(u32, Rule)> = rules.iter().copied().zip(0..).map(|(r, i)| (i, r)).collect();
            let longest = |t: &Tree<FIELDS>| t.spans.iter().map(|&(_, len)| len as usize).max().unwrap_or(0);
            let capped = Tree::build_to(&ids, usize::MAX, FIVE_TUPLE.max, cap).expect("no budget");
            let whole = Tree::build_to(&ids, usize::MAX, FIVE_TUPLE.max, usize::MAX).expect("no budget");
            prop_assert!(longest(&capped) <= CAPPED_LEAF_RULES.max(longest(&whole)));
            let all: Vec<Option<Rule>> = rules.iter().copied().map(Some).collect();
            let dead: Vec<AtomicU64> = (0..rules.len().div_ceil(64)).map(|_| AtomicU64::new(0)).collect();
            for k in &keys {
                prop_assert_eq!(capped.lookup(k, &dead), linear(&all, k));
            }
        }

        #[test]
        fn agrees_with_a_linear_scan(rules in proptest::collection::vec(rule(), 0..120), keys in proptest::collection::vec(key(), 1..60)) {
            let c = Classifier::new(&rules);
            let all: Vec<Option<Rule>> = rules.iter().copied().map(Some).collect();
            for k in &keys {
                prop_assert_eq!(c.classify(k), linear(&all, k));
            }
            let mut out = vec![None; keys.len()];
            c.classify_batch(&keys, &mut out);
            let want: Vec<Option<u32>> = keys.iter().map(|k| linear(&all, k)).collect();
            prop_assert_eq!(out, want);
        }

        #[test]
        fn agrees_after_inserts_and_deletes(
            rules in proptest::collection::vec(rule(), 0..80),
            updates in proptest::collection::vec((0u8..3, 0u32..100, rule()), 0..80),
            keys in proptest::collection::vec(key(), 1..40),
        ) {
            let c = Classifier::new(&rules);
            let mut model: Vec<Option<Rule>> = rules.iter().copied().map(Some).collect();
            for (i, (op, id, r)) in updates.into_iter().enumerate() {
                // Re-inserting a rule as it was built revives it in the trees; any other
                // rule at an id is new to them.
                let r = match rules.get(id as usize) {
                    Some(original) if op == 2 => *original,
                    _ => r,
                };
                update(&c, &mut model, id, (op > 0).then_some(r))?;
                if i % 17 == 16 {
                    c.rebuild();
                }
                for k in &keys {
                    prop_assert_eq!(c.classify(k), linear(&model, k));
                }
            }
        }
    }
}
