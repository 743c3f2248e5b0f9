//! Lookup structures for the three pipe bodies: ordered rules, exact-match tables and
//! longest-prefix-match tables.

use super::field::{self, PacketState};
use super::parse::Meta;
use crate::ir::{Field, FieldId, FieldMatch, Pattern, Rule};
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

/// Ordered rules, first match wins. The scan below is the reference implementation; a
/// faster classifier can replace it behind this trait.
pub trait RuleClassifier: std::fmt::Debug + Send {
    /// Index of the first rule that matches, if any.
    fn classify(&self, pkt: &PacketView<'_>) -> Option<usize>;
}

/// Checks every rule in order.
#[derive(Debug)]
pub struct LinearScan {
    rules: Vec<Box<[FieldMatch]>>,
}

impl LinearScan {
    pub fn new(rules: &[Rule]) -> LinearScan {
        LinearScan {
            rules: rules
                .iter()
                .map(|r| r.matches.clone().into_boxed_slice())
                .collect(),
        }
    }
}

impl RuleClassifier for LinearScan {
    fn classify(&self, pkt: &PacketView<'_>) -> Option<usize> {
        self.rules
            .iter()
            .position(|ms| ms.iter().all(|m| pkt.holds(m)))
    }
}

/// Longest keys an exact table takes (the language allows 8 fields).
pub const MAX_EXACT_FIELDS: usize = 8;

/// Exact match on a tuple of fields. Keys whose fields fit in 128 bits together (the
/// common case: addresses and ports) are packed into one integer, so a lookup hashes and
/// compares a single `u128`.
#[derive(Debug)]
pub struct ExactTable {
    fields: Box<[Field]>,
    map: ExactMap,
}

#[derive(Debug)]
enum ExactMap {
    Packed(FxHashMap<u128, usize>),
    Wide(FxHashMap<Box<[u128]>, usize>),
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
    pub fn new(fields: &[Field], keys: impl IntoIterator<Item = Vec<u128>>) -> ExactTable {
        let width: u32 = fields.iter().map(|f| u32::from(f.kind().bits())).sum();
        let map = if width <= 128 {
            ExactMap::Packed(
                keys.into_iter()
                    .enumerate()
                    .map(|(i, k)| (pack(fields, k).expect("width checked"), i))
                    .collect(),
            )
        } else {
            ExactMap::Wide(
                keys.into_iter()
                    .enumerate()
                    .map(|(i, k)| (k.into_boxed_slice(), i))
                    .collect(),
            )
        };
        ExactTable {
            fields: fields.into(),
            map,
        }
    }

    #[inline]
    pub fn lookup(&self, pkt: &PacketView<'_>) -> Option<usize> {
        match &self.map {
            ExactMap::Packed(map) => {
                let mut key = 0u128;
                for f in self.fields.iter() {
                    let bits = u32::from(f.kind().bits());
                    let v = pkt.field(*f)?;
                    key = if bits == 128 { v } else { key << bits | v };
                }
                map.get(&key).copied()
            }
            ExactMap::Wide(map) => {
                let mut key = [0u128; MAX_EXACT_FIELDS];
                for (slot, f) in key.iter_mut().zip(self.fields.iter()) {
                    *slot = pkt.field(*f)?;
                }
                map.get(&key[..self.fields.len()]).copied()
            }
        }
    }
}

/// Longest-prefix match: one hash map per prefix length in use, longest first.
#[derive(Debug)]
pub struct LpmTable {
    field: Field,
    /// (prefix length, mask, prefix → entry index), longest prefix first.
    levels: Vec<(u8, u128, FxHashMap<u128, usize>)>,
}

impl LpmTable {
    pub fn new(field: Field, prefixes: impl IntoIterator<Item = (u128, u8)>) -> LpmTable {
        let kind = field.kind();
        let mut levels: Vec<(u8, u128, FxHashMap<u128, usize>)> = Vec::new();
        for (i, (value, len)) in prefixes.into_iter().enumerate() {
            let Pattern::Masked { mask, value } = Pattern::prefix(value, len, kind) else {
                unreachable!("prefix patterns are masks")
            };
            match levels.iter_mut().find(|(l, _, _)| *l == len) {
                Some((_, _, m)) => {
                    m.insert(value, i);
                }
                None => {
                    let mut m = FxHashMap::default();
                    m.insert(value, i);
                    levels.push((len, mask, m));
                }
            }
        }
        levels.sort_by_key(|l| std::cmp::Reverse(l.0));
        LpmTable { field, levels }
    }

    #[inline]
    pub fn lookup(&self, pkt: &PacketView<'_>) -> Option<usize> {
        let v = pkt.field(self.field)?;
        self.levels
            .iter()
            .find_map(|(_, mask, m)| m.get(&(v & mask)).copied())
    }
}

/// Rule pipes over the IPv4 5-tuple use the firewall's classifier; other packets (IPv6,
/// non-IP) fall back to the scan, which gives the same answers for them.
#[derive(Debug)]
pub struct FiveTuple {
    acl: crate::firewall::acl::Classifier,
    fallback: LinearScan,
}

/// Pipes with fewer rules than this keep the plain scan.
pub const FIVE_TUPLE_MIN_RULES: usize = 64;

/// A port value no rule range contains: packets without L4 ports match only rules that
/// leave the ports open (as `l4.src`/`l4.dst` never match such packets).
const NO_PORT: u32 = 65536;

impl FiveTuple {
    /// The classifier for `rules`, when every match is on an IPv4 address, `ip.proto`
    /// (exact or wildcard) or an `l4` port, outer headers only.
    pub fn new(rules: &[Rule]) -> Option<FiveTuple> {
        use crate::firewall::acl;
        let mut out = Vec::with_capacity(rules.len());
        for r in rules {
            let mut a = acl::Rule {
                lo: [0; 5],
                hi: [u32::MAX, u32::MAX, u32::MAX, u32::MAX, 255],
                proto: (0, 0),
            };
            for m in &r.matches {
                if m.field.inner {
                    return None;
                }
                let (lo, hi) = match m.pattern {
                    Pattern::Range { lo, hi } => (lo, hi),
                    Pattern::Masked { value, mask } => {
                        let host = !mask & m.field.kind().full_mask();
                        if host & host.wrapping_add(1) != 0 {
                            return None;
                        }
                        (value, value | host)
                    }
                    Pattern::Any(_) => return None,
                };
                let f = match m.field.id {
                    FieldId::Ipv4Src => 0,
                    FieldId::Ipv4Dst => 1,
                    FieldId::L4Src => 2,
                    FieldId::L4Dst => 3,
                    FieldId::IpProto if lo == hi => {
                        a.proto = (lo as u8, 0xff);
                        4
                    }
                    _ => return None,
                };
                a.lo[f] = lo as u32;
                a.hi[f] = hi as u32;
            }
            out.push(a);
        }
        Some(FiveTuple {
            acl: acl::Classifier::new(&out),
            fallback: LinearScan::new(rules),
        })
    }
}

impl RuleClassifier for FiveTuple {
    fn classify(&self, pkt: &PacketView<'_>) -> Option<usize> {
        let l = &pkt.meta.outer;
        if l.l3_kind != super::parse::L3::V4 {
            return self.fallback.classify(pkt);
        }
        let v = |f: FieldId| {
            pkt.field(Field {
                id: f,
                inner: false,
            })
        };
        let port = |f| v(f).map_or(NO_PORT, |p| p as u32);
        let key = crate::firewall::acl::Key([
            v(FieldId::Ipv4Src).unwrap_or(0) as u32,
            v(FieldId::Ipv4Dst).unwrap_or(0) as u32,
            port(FieldId::L4Src),
            port(FieldId::L4Dst),
            v(FieldId::IpProto).unwrap_or(0) as u32,
        ]);
        self.acl.classify(&key).map(|i| i as usize)
    }
}
