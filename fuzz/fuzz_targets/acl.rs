//! The firewall's rule classifier against a linear scan: built from any rules, then any
//! inserts, removals and rebuilds, every key classifies to the first rule that matches.
//!
//! Input: a count of rules to build from (one byte), then operations, each a byte and its
//! operands: insert a rule (an id byte and the rule's 26 bytes), remove (an id byte),
//! rebuild, or classify a key (13 bytes) or a key at a corner of a rule held (a byte
//! choosing the rule, a byte choosing the corner). A rule is, per field of the 5-tuple, two
//! values in the field's width (the range between them), then a value/mask test.
#![no_main]

use dpuflow::firewall::acl::{Classifier, Key, Masked, Rule, FIELDS};
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;

/// The width of each field in bytes: addresses, ports, protocol.
const WIDTHS: [usize; FIELDS] = [4, 4, 2, 2, 1];
/// Ids of rules inserted: enough to collide with the built ones and each other.
const IDS: u32 = 96;

struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn take(&mut self, n: usize) -> Option<u32> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head.iter().fold(0, |v, b| v << 8 | u32::from(*b)))
    }

    fn rule(&mut self) -> Option<Rule> {
        let mut r = Rule::any([0; FIELDS]);
        for (f, w) in WIDTHS.iter().enumerate() {
            let (a, b) = (self.take(*w)?, self.take(*w)?);
            (r.lo[f], r.hi[f]) = (a.min(b), a.max(b));
        }
        let test = self.take(1)?;
        if test & 0x80 != 0 {
            r.masked[0] = Masked {
                field: (test % FIELDS as u32) as u8,
                value: self.take(1)?,
                mask: self.take(1)?,
            };
        }
        Some(r)
    }

    fn key(&mut self) -> Option<Key> {
        let mut k = Key::default();
        for (f, w) in WIDTHS.iter().enumerate() {
            k.0[f] = self.take(*w)?;
        }
        Some(k)
    }
}

/// The first rule, in id order, that matches `k`.
fn scan(rules: &BTreeMap<u32, Rule>, k: &Key) -> Option<u32> {
    rules.iter().find(|(_, r)| r.matches(k)).map(|(id, _)| *id)
}

fuzz_target!(|bytes: &[u8]| {
    let mut input = Bytes(bytes);
    let Some(count) = input.take(1) else {
        return;
    };
    let mut held = BTreeMap::new();
    let mut built = Vec::new();
    for id in 0..count % 64 {
        let Some(r) = input.rule() else {
            return;
        };
        built.push(r);
        held.insert(id, r);
    }
    let classifier = Classifier::new(&built);
    while let Some(op) = input.take(1) {
        let key = match op % 8 {
            0 | 1 => {
                let (Some(id), Some(r)) = (input.take(1), input.rule()) else {
                    return;
                };
                classifier.insert(id % IDS, r);
                held.insert(id % IDS, r);
                continue;
            }
            2 => {
                let Some(id) = input.take(1) else {
                    return;
                };
                assert_eq!(
                    classifier.remove(id % IDS),
                    held.remove(&(id % IDS)).is_some()
                );
                continue;
            }
            3 => {
                classifier.rebuild();
                continue;
            }
            4 | 5 => match input.key() {
                Some(k) => k,
                None => return,
            },
            _ => {
                let (Some(which), Some(corner)) = (input.take(1), input.take(1)) else {
                    return;
                };
                let Some(r) = held.values().nth(which as usize % held.len().max(1)) else {
                    continue;
                };
                // Each field at its low or high end, or one past it within the field.
                let mut k = Key::default();
                for (f, w) in WIDTHS.iter().enumerate() {
                    let (lo, hi) = (r.lo[f], r.hi[f]);
                    let max = u32::MAX >> (32 - 8 * w);
                    k.0[f] = match corner >> (f % 4 * 2) & 3 {
                        0 => lo,
                        1 => hi,
                        2 => lo.saturating_sub(1),
                        _ => hi.saturating_add(1).min(max),
                    };
                }
                k
            }
        };
        assert_eq!(classifier.classify(&key), scan(&held, &key), "{key:?}");
        let mut out = [None];
        classifier.classify_batch(&[key], &mut out);
        assert_eq!(out[0], scan(&held, &key), "batch {key:?}");
    }
});
