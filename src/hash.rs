//! A keyed hash of a few machine words, for the tables that packets from the wire index
//! (connections, flows). The key is secret and random per table, so nobody sending
//! packets can aim flows at one bucket; the hash itself is a handful of independent
//! 64×64→128 multiplies (the folded multiply of wyhash and aHash's fallback), a few
//! nanoseconds for a 5-tuple. It is not a cryptographic PRF: it makes collisions
//! unpredictable to a sender who never sees the hashes, which is what a table needs.

use std::hash::BuildHasher;

/// Words a key may have.
const MAX_WORDS: usize = 8;

#[derive(Debug, Clone)]
pub struct KeyedHash {
    keys: [u64; MAX_WORDS + 1],
}

/// The high and low halves of a full product, xored: every input bit reaches the middle
/// bits of the result.
#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ (p >> 64) as u64
}

impl KeyedHash {
    /// A hash with fresh random keys (from the OS's randomness, through std's keyed SipHash).
    pub fn new() -> KeyedHash {
        let seed = std::collections::hash_map::RandomState::new();
        KeyedHash {
            keys: std::array::from_fn(|i| seed.hash_one(i)),
        }
    }

    /// The hash of `words` (at most eight). Words are taken in pairs, each pair xored with
    /// its own key words and folded; the pairs' results are independent, so they multiply
    /// in parallel, and one last fold mixes their sum.
    #[inline(always)]
    pub fn hash<const N: usize>(&self, words: [u64; N]) -> u64 {
        const { assert!(N <= MAX_WORDS) };
        let k = &self.keys;
        let mut acc = 0u64;
        let mut i = 0;
        while i + 1 < N {
            acc = acc.wrapping_add(fold(words[i] ^ k[i], words[i + 1] ^ k[i + 1]));
            i += 2;
        }
        if i < N {
            acc = acc.wrapping_add(fold(words[i] ^ k[i], k[MAX_WORDS]));
        }
        fold(acc ^ k[MAX_WORDS], (N as u64) ^ k[0].rotate_left(32))
    }

    /// The hash of `bytes`, of any length: 16 bytes at a time, each pair of words xored
    /// with key words and folded into the running value, the last pair padded with zeros
    /// and the length mixed in at the end. A chain, so a long key costs a fold per 16
    /// bytes in turn; keys a client names are short.
    pub fn hash_bytes(&self, bytes: &[u8]) -> u64 {
        let k = &self.keys;
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("eight bytes"));
        let mut acc = k[MAX_WORDS];
        let mut chunks = bytes.chunks_exact(16);
        for (i, c) in (&mut chunks).enumerate() {
            let j = 2 * i % MAX_WORDS;
            acc = fold(acc ^ word(&c[..8]) ^ k[j], word(&c[8..]) ^ k[j + 1]);
        }
        let mut tail = [0u8; 16];
        let rest = chunks.remainder();
        tail[..rest.len()].copy_from_slice(rest);
        let acc = fold(acc ^ word(&tail[..8]) ^ k[1], word(&tail[8..]) ^ k[2]);
        fold(acc ^ bytes.len() as u64, k[3])
    }
}

impl Default for KeyedHash {
    fn default() -> KeyedHash {
        KeyedHash::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Byte strings that differ in one byte, or only in length (a zero byte more), hash
    /// apart and spread over buckets.
    #[test]
    fn byte_strings_spread_evenly() {
        let h = KeyedHash::new();
        let mut buckets = [0u32; 64];
        let mut seen = HashSet::new();
        for n in 0..65536u32 {
            let key = format!("model-a/layer-{:02}/block-{:08}", n % 61, n);
            let x = h.hash_bytes(key.as_bytes());
            seen.insert(x);
            buckets[(x >> 58) as usize] += 1;
        }
        assert_eq!(seen.len(), 65536);
        assert!(buckets.iter().all(|&b| b < 2 * 1024), "{buckets:?}");
        assert_ne!(h.hash_bytes(b"ab"), h.hash_bytes(b"ab\0"));
        assert_ne!(h.hash_bytes(b""), h.hash_bytes(b"\0"));
        assert_ne!(h.hash_bytes(&[7; 33]), h.hash_bytes(&[7; 32]));
    }

    #[test]
    fn keys_differ_between_tables() {
        let (a, b) = (KeyedHash::new(), KeyedHash::new());
        assert_ne!(a.hash([1, 2, 3]), b.hash([1, 2, 3]));
        assert_eq!(a.hash([1, 2, 3]), a.hash([1, 2, 3]));
    }

    /// Keys that differ in one bit of one word (a port, one address bit) spread over
    /// buckets like random numbers: no bucket of 1024 gets more than a few times its share.
    #[test]
    fn one_bit_changes_spread_evenly() {
        let h = KeyedHash::new();
        for word in 0..5 {
            let mut buckets = [0u32; 1024];
            let mut seen = HashSet::new();
            for n in 0..65536u64 {
                let mut w = [0x0a00_0001, 0x0a00_0002, 0, 0, 0x0050_1f90_0600_0000];
                w[word] ^= n << (word * 7 % 48);
                let x = h.hash(w);
                seen.insert(x);
                buckets[(x & 1023) as usize] += 1;
            }
            assert_eq!(seen.len(), 65536, "word {word}: full hashes collided");
            let max = buckets.iter().max().unwrap();
            assert!(*max < 64 * 3, "word {word}: a bucket got {max} of 65536");
        }
    }
}
