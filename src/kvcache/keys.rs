//! The index's map of keys, in shards. A hash map that outgrows its table moves every key
//! it holds to a table twice the size, in one go, with the index's lock held: one map of
//! 3.7 million keys took 0.9 s to double here, 0.2 s at 0.9 million, and every client
//! waited that long while the cache first filled. In 64 maps, each growing alone, a key
//! that makes one outgrow its table moves a 64th of the keys.

use crate::hash::KeyedHash;
use std::collections::HashMap;
use std::sync::Arc;

/// Maps, a power of two.
const SHARDS: usize = 64;

/// The map of a key whose hash is `h`: its top bits.
fn shard_of(h: u64) -> usize {
    (h >> (64 - SHARDS.trailing_zeros())) as usize
}

/// A step of a walk over the keys in the order of their hashes ([`Keys::walk`]).
#[derive(Debug)]
pub struct WalkStep {
    /// The keys found, with their hashes, in the order of their hashes.
    pub found: Vec<(u64, Arc<[u8]>)>,
    /// Whether keys with greater hashes may be left.
    pub more: bool,
}

/// A value, and its key's hash (which picked the key's map), kept so that a walk reads it
/// instead of hashing every key of a map again at each step.
#[derive(Debug)]
struct Held<V> {
    hash: u64,
    value: V,
}

/// One of the maps.
type Map<V> = HashMap<Arc<[u8]>, Held<V>>;

/// Keys → `V`, in [`SHARDS`] hash maps.
#[derive(Debug)]
pub struct Keys<V> {
    shards: Box<[Map<V>]>,
    /// Picks a key's map: a hash of its own, so the maps' hashers' bits still tell apart
    /// the keys within a map (which bucket, and the tag compared before the key); keyed,
    /// so a client cannot aim its keys at one map; a tenth of the cost of the maps'
    /// SipHash, paid again by every lookup.
    pick: KeyedHash,
    len: usize,
}

impl<V> Keys<V> {
    pub fn new() -> Keys<V> {
        Keys {
            shards: (0..SHARDS).map(|_| HashMap::new()).collect(),
            pick: KeyedHash::new(),
            len: 0,
        }
    }

    fn shard(&self, key: &[u8]) -> usize {
        shard_of(self.pick.hash_bytes(key))
    }

    /// The `most` keys (at least one) with the least hashes (fixed for the map's life) at
    /// or past `from` among those whose value `keep` keeps, and any more that share the
    /// last one's hash, so that the next step can go on from the hash after it. Looks at
    /// the map `from` falls in, then at each map after until it has seen `most`: the maps
    /// are in the order of their hashes' top bits, so a step reads a map's share of the
    /// keys rather than every key, and copies out only the keys it returns.
    pub fn walk(&self, from: u64, most: usize, keep: impl Fn(&V) -> bool) -> WalkStep {
        let most = most.max(1);
        let mut seen: Vec<(u64, &Arc<[u8]>)> = Vec::new();
        let mut more = false;
        for map in self.shards.iter().skip(shard_of(from)) {
            if seen.len() >= most {
                more = true;
                break;
            }
            seen.extend(
                map.iter()
                    .filter(|(_, held)| held.hash >= from && keep(&held.value))
                    .map(|(k, held)| (held.hash, k)),
            );
        }
        if seen.len() > most {
            let (_, &mut (last, _), _) = seen.select_nth_unstable_by_key(most - 1, |(h, _)| *h);
            let before = seen.len();
            seen.retain(|(h, _)| *h <= last);
            more |= seen.len() < before;
        }
        seen.sort_unstable_by_key(|(h, _)| *h);
        WalkStep {
            found: seen.into_iter().map(|(h, k)| (h, Arc::clone(k))).collect(),
            more,
        }
    }

    /// The keys of map `map` whose value `keep` keeps, in no particular order; `None` past
    /// the last map.
    pub fn keys_of_map(&self, map: usize, keep: impl Fn(&V) -> bool) -> Option<Vec<Arc<[u8]>>> {
        let map = self.shards.get(map)?;
        Some(
            map.iter()
                .filter(|(_, held)| keep(&held.value))
                .map(|(k, _)| Arc::clone(k))
                .collect(),
        )
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, key: &[u8]) -> Option<&V> {
        self.shards[self.shard(key)]
            .get(key)
            .map(|held| &held.value)
    }

    pub fn get_mut(&mut self, key: &[u8]) -> Option<&mut V> {
        let s = self.shard(key);
        self.shards[s].get_mut(key).map(|held| &mut held.value)
    }

    pub fn get_key_value(&self, key: &[u8]) -> Option<(&Arc<[u8]>, &V)> {
        self.shards[self.shard(key)]
            .get_key_value(key)
            .map(|(k, held)| (k, &held.value))
    }

    pub fn contains_key(&self, key: &[u8]) -> bool {
        self.get(key).is_some()
    }

    /// Puts `key` in, giving back the value it had.
    pub fn insert(&mut self, key: Arc<[u8]>, value: V) -> Option<V> {
        let hash = self.pick.hash_bytes(&key);
        let old = self.shards[shard_of(hash)]
            .insert(key, Held { hash, value })
            .map(|held| held.value);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    pub fn remove_entry(&mut self, key: &[u8]) -> Option<(Arc<[u8]>, V)> {
        let s = self.shard(key);
        let removed = self.shards[s]
            .remove_entry(key)
            .map(|(k, held)| (k, held.value));
        if removed.is_some() {
            self.len -= 1;
        }
        removed
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<V> {
        self.remove_entry(key).map(|(_, v)| v)
    }

    pub fn clear(&mut self) {
        self.shards.iter_mut().for_each(HashMap::clear);
        self.len = 0;
    }

    /// Every key and value, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Arc<[u8]>, &V)> {
        self.shards
            .iter()
            .flatten()
            .map(|(k, held)| (k, &held.value))
    }

    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.iter().map(|(_, v)| v)
    }
}

impl<V> Default for Keys<V> {
    fn default() -> Keys<V> {
        Keys::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Keys spread over the maps: no map of 64 gets more than twice its share of 64k keys.
    #[test]
    fn keys_spread_over_the_maps() {
        let mut k = Keys::new();
        for i in 0..65_536u32 {
            k.insert(Arc::from(format!("layer-{i:08}").as_bytes()), ());
        }
        assert_eq!(k.len(), 65_536);
        assert!(k.shards.iter().all(|m| m.len() < 2 * 65_536 / SHARDS));
    }

    proptest! {
        /// A walk in steps of `most` (as `SCAN` takes them) finds every key its `keep`
        /// keeps once, in the order of their hashes, a short step the last; the maps one
        /// by one hold the same keys.
        #[test]
        fn a_walk_in_steps_finds_every_key_once(n in 0u32..2000, most in 1usize..300) {
            let mut k = Keys::new();
            for i in 0..n {
                k.insert(Arc::from(format!("k{i}").as_bytes()), i);
            }
            let keep = |v: &u32| v % 3 != 0;
            let (mut from, mut walked) = (0u64, Vec::new());
            loop {
                let WalkStep { found, more } = k.walk(from, most, keep);
                // No two of these keys share a hash.
                prop_assert!(found.len() <= most);
                prop_assert!(found.len() == most || !more);
                walked.extend(found.iter().map(|(h, key)| (*h, key.to_vec())));
                match (more, found.last()) {
                    (true, Some(&(last, _))) => from = last + 1,
                    _ => break,
                }
            }
            prop_assert!(walked.windows(2).all(|w| w[0].0 < w[1].0));
            let mut keys: Vec<Vec<u8>> = walked.into_iter().map(|(_, key)| key).collect();
            keys.sort();
            let mut want: Vec<Vec<u8>> =
                k.iter().filter(|(_, v)| keep(v)).map(|(key, _)| key.to_vec()).collect();
            want.sort();
            prop_assert_eq!(&keys, &want);
            let mut by_map: Vec<Vec<u8>> = (0..)
                .map_while(|m| k.keys_of_map(m, keep))
                .flatten()
                .map(|key| key.to_vec())
                .collect();
            by_map.sort();
            prop_assert_eq!(by_map, want);
        }

        /// Inserts, removals and lookups agree with one hash map.
        #[test]
        fn keys_behave_as_one_map(ops in proptest::collection::vec((0u8..3, 0u16..300, any::<u32>()), 1..600)) {
            let mut keys = Keys::new();
            let mut model = HashMap::new();
            for (op, key, value) in ops {
                let key: Arc<[u8]> = Arc::from(key.to_be_bytes().as_slice());
                match op {
                    0 => prop_assert_eq!(keys.insert(Arc::clone(&key), value), model.insert(key, value)),
                    1 => prop_assert_eq!(keys.remove_entry(&key), model.remove_entry(&key)),
                    _ => {
                        prop_assert_eq!(keys.get(&key), model.get(&key));
                        if let Some(v) = keys.get_mut(&key) {
                            *v = v.wrapping_add(1);
                            *model.get_mut(&key).expect("held") += 1;
                        }
                    }
                }
                prop_assert_eq!(keys.len(), model.len());
            }
            let mut all: Vec<(Arc<[u8]>, u32)> = keys.iter().map(|(k, v)| (Arc::clone(k), *v)).collect();
            let mut want: Vec<(Arc<[u8]>, u32)> = model.into_iter().collect();
            all.sort();
            want.sort();
            prop_assert_eq!(all, want);
            keys.clear();
            prop_assert!(keys.is_empty() && keys.iter().next().is_none());
        }
    }
}
