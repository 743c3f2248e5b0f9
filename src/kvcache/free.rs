//! The free blocks of a KV-cache store, one bit a block: a store of a hundred million
//! blocks keeps them in 12 MiB (a list of block numbers took 8 bytes a free block), and the
//! longest runs of free blocks, which a saved index is written to, come from one pass over
//! the words rather than a sort of every free block.

use super::index::Run;

/// A set of free blocks.
#[derive(Debug)]
pub struct FreeSet {
    /// Bit `b % 64` of word `b / 64` is set while block `b` is free.
    words: Vec<u64>,
    /// Bit `i % 64` of summary word `i / 64` is set while word `i` has a free block, and
    /// bit `j % 64` of top word `j / 64` while summary word `j` has a bit set: a search
    /// for a free block skips 4,096 taken blocks a summary word and 262,144 a top word,
    /// so a full store whose few free blocks are anywhere finds them in a pass over a
    /// 262,144th of it.
    summary: Vec<u64>,
    top: Vec<u64>,
    /// Blocks free.
    len: u64,
    /// The word the next [`FreeSet::take`] starts at (next fit): a fresh store hands out
    /// its blocks in order, so values get runs, and blocks freed behind are found when the
    /// search comes round to them.
    cursor: usize,
}

impl FreeSet {
    /// No block free, of `total`.
    pub fn new(total: u64) -> FreeSet {
        let words = total.div_ceil(64) as usize;
        FreeSet {
            words: vec![0; words],
            summary: vec![0; words.div_ceil(64)],
            top: vec![0; words.div_ceil(64 * 64)],
            len: 0,
            cursor: 0,
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn contains(&self, block: u64) -> bool {
        self.words
            .get((block / 64) as usize)
            .is_some_and(|w| w >> (block % 64) & 1 == 1)
    }

    /// Frees `blocks` (none free already, none past the store).
    pub fn put(&mut self, blocks: impl IntoIterator<Item = u64>) {
        for b in blocks {
            let i = (b / 64) as usize;
            debug_assert_eq!(self.words[i] >> (b % 64) & 1, 0, "block {b} freed twice");
            self.words[i] |= 1 << (b % 64);
            self.summary[i / 64] |= 1 << (i % 64);
            self.top[i / 4096] |= 1 << (i / 64 % 64);
            self.len += 1;
        }
    }

    /// Takes block `b`, free.
    fn clear(&mut self, b: u64) {
        let i = (b / 64) as usize;
        self.words[i] &= !(1 << (b % 64));
        if self.words[i] == 0 {
            self.summary[i / 64] &= !(1 << (i % 64));
            if self.summary[i / 64] == 0 {
                self.top[i / 4096] &= !(1 << (i / 64 % 64));
            }
        }
    }

    /// `n` free blocks, taken: the first free from where the last search stopped,
    /// ascending (round to the start at the end); `None`, taking none, when fewer are free.
    pub fn take(&mut self, n: u64) -> Option<Vec<u64>> {
        if n > self.len {
            return None;
        }
        let mut blocks = Vec::with_capacity(n as usize);
        while (blocks.len() as u64) < n {
            // Some word has a free block: if none from the cursor on, one before it.
            let i = self
                .word_with_free(self.cursor)
                .or_else(|| self.word_with_free(0))
                .expect("fewer blocks taken than are free");
            self.cursor = i;
            while self.words[i] != 0 && (blocks.len() as u64) < n {
                let b = i as u64 * 64 + u64::from(self.words[i].trailing_zeros());
                self.clear(b);
                blocks.push(b);
            }
        }
        self.len -= n;
        Some(blocks)
    }

    /// Takes `blocks` if every one is free; whether they were (none is taken otherwise).
    pub fn take_these(&mut self, blocks: &[u64]) -> bool {
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != blocks.len() || !sorted.iter().all(|&b| self.contains(b)) {
            return false;
        }
        sorted.into_iter().for_each(|b| self.clear(b));
        self.len -= blocks.len() as u64;
        true
    }

    /// `n` free blocks from the fewest runs of free blocks, taken: the longest runs first,
    /// each ascending (a saved index's blocks, which the superblock names as runs);
    /// `None`, taking none, when fewer are free.
    pub fn take_longest_runs(&mut self, n: u64) -> Option<Vec<u64>> {
        if n > self.len {
            return None;
        }
        let mut runs: Vec<Run> = self.runs().collect();
        // No more than `n` runs can be wanted: the `n` longest, longest first.
        let longest_first = |a: &Run, b: &Run| b.1.cmp(&a.1).then(a.0.cmp(&b.0));
        if runs.len() as u64 > n && n > 0 {
            runs.select_nth_unstable_by(n as usize - 1, longest_first);
            runs.truncate(n as usize);
        }
        runs.sort_unstable_by(longest_first);
        let mut blocks = Vec::with_capacity(n as usize);
        for (first, len) in runs {
            let wanted = (n - blocks.len() as u64).min(len);
            blocks.extend(first..first + wanted);
            if blocks.len() as u64 == n {
                break;
            }
        }
        let taken = self.take_these(&blocks);
        debug_assert!(taken);
        Some(blocks)
    }

    /// The runs of free blocks, ascending.
    fn runs(&self) -> impl Iterator<Item = Run> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            let first = self.next_free(at)?;
            let end = self.next_taken(first);
            at = end;
            Some((first, end - first))
        })
    }

    /// The first word from `i` on with a free block.
    fn word_with_free(&self, i: usize) -> Option<usize> {
        if *self.words.get(i)? != 0 {
            return Some(i);
        }
        // In the rest of its summary word, or the first summary word after with a bit.
        let s = (i + 1) / 64;
        let here = self
            .summary
            .get(s)
            .map_or(0, |w| w & (!0 << ((i + 1) % 64)));
        if here != 0 {
            return Some(s * 64 + here.trailing_zeros() as usize);
        }
        let s = first_set(&self.top, s + 1)?;
        Some(s * 64 + self.summary[s].trailing_zeros() as usize)
    }

    /// The first free block from `from` on.
    fn next_free(&self, from: u64) -> Option<u64> {
        let i = (from / 64) as usize;
        let here = self.words.get(i)? & (!0 << (from % 64));
        if here != 0 {
            return Some(i as u64 * 64 + u64::from(here.trailing_zeros()));
        }
        let i = self.word_with_free(i + 1)?;
        Some(i as u64 * 64 + u64::from(self.words[i].trailing_zeros()))
    }

    /// The first block from `from` on that is not free (blocks past the store are not).
    fn next_taken(&self, from: u64) -> u64 {
        let mut i = (from / 64) as usize;
        let mut taken = !self.words[i] & (!0 << (from % 64));
        while taken == 0 {
            i += 1;
            match self.words.get(i) {
                Some(w) => taken = !w,
                None => return i as u64 * 64,
            }
        }
        i as u64 * 64 + u64::from(taken.trailing_zeros())
    }
}

/// The first bit set in `bits` from bit `from` on.
fn first_set(bits: &[u64], from: usize) -> Option<usize> {
    let mut i = from / 64;
    let mut word = bits.get(i)? & (!0 << (from % 64));
    while word == 0 {
        i += 1;
        word = *bits.get(i)?;
    }
    Some(i * 64 + word.trailing_zeros() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn a_fresh_store_hands_out_its_blocks_in_order() {
        let mut free = FreeSet::new(200);
        free.put(1..200);
        assert_eq!(free.take(3), Some(vec![1, 2, 3]));
        assert_eq!(free.take(70), Some((4..74).collect()));
        // Freed behind the search, found once it comes round.
        free.put([2]);
        assert_eq!(free.take(126), Some((74..200).collect()));
        assert_eq!(free.take(1), Some(vec![2]));
        assert_eq!(free.len(), 0);
        assert_eq!(free.take(1), None);
    }

    #[test]
    fn a_save_takes_the_longest_runs() {
        let mut free = FreeSet::new(300);
        free.put((10..12).chain(20..30).chain(64..200).chain(250..251));
        assert_eq!(
            free.runs().collect::<Vec<_>>(),
            [(10, 2), (20, 10), (64, 136), (250, 1)]
        );
        let blocks = free.take_longest_runs(140).unwrap();
        assert_eq!(blocks, (64..200).chain(20..24).collect::<Vec<_>>());
        assert_eq!(
            free.runs().collect::<Vec<_>>(),
            [(10, 2), (24, 6), (250, 1)]
        );
        assert_eq!(free.take_longest_runs(10), None);
        assert_eq!(free.len(), 9);
    }

    #[test]
    fn blocks_named_are_taken_only_when_all_free() {
        let mut free = FreeSet::new(100);
        free.put(0..10);
        assert!(!free.take_these(&[3, 4, 50]));
        assert!(!free.take_these(&[3, 3]));
        assert_eq!(free.len(), 10);
        assert!(free.take_these(&[4, 3]));
        assert!(!free.contains(3) && free.contains(5));
        assert_eq!(free.len(), 8);
    }

    #[test]
    fn free_blocks_far_apart_are_found() {
        let mut free = FreeSet::new(1 << 17);
        free.put([130_000, 5, 70_000]);
        assert_eq!(
            free.runs().collect::<Vec<_>>(),
            [(5, 1), (70_000, 1), (130_000, 1)]
        );
        assert_eq!(free.take(2), Some(vec![5, 70_000]));
        free.put([3]);
        assert_eq!(free.take(2), Some(vec![130_000, 3]));
        assert_eq!(free.take(1), None);
        free.put((1 << 17) - 64..1 << 17);
        assert_eq!(free.runs().collect::<Vec<_>>(), [((1 << 17) - 64, 64)]);
        assert_eq!(free.take_longest_runs(64).map(|b| b.len()), Some(64));
        assert!(free.summary.iter().chain(&free.top).all(|&s| s == 0));
        // Past a top word (262,144 blocks).
        let mut free = FreeSet::new(1 << 20);
        free.put([900_000, 3, 500_000]);
        assert_eq!(free.take(2), Some(vec![3, 500_000]));
        free.put([1]);
        assert_eq!(free.take(2), Some(vec![900_000, 1]));
        assert!(free.top.iter().all(|&t| t == 0));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take(u8),
        Runs(u8),
        Put(Vec<u16>),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0..80u8).prop_map(Op::Take),
            (0..80u8).prop_map(Op::Runs),
            proptest::collection::vec(0..300u16, 0..40).prop_map(Op::Put),
        ]
    }

    proptest::proptest! {
        /// Against a set of block numbers: blocks taken were free and are no longer, the
        /// count agrees, runs are the set's runs, and a save's runs are the longest.
        #[test]
        fn agrees_with_a_set(ops in proptest::collection::vec(op(), 1..60)) {
            let mut free = FreeSet::new(300);
            let mut model: BTreeSet<u64> = (0..300).collect();
            free.put(0..300);
            for o in ops {
                match o {
                    Op::Take(n) | Op::Runs(n) => {
                        let n = u64::from(n);
                        let runs_before: Vec<Run> = free.runs().collect();
                        let taken = match o {
                            Op::Take(_) => free.take(n),
                            _ => free.take_longest_runs(n),
                        };
                        let Some(taken) = taken else {
                            proptest::prop_assert!(n > model.len() as u64);
                            continue;
                        };
                        proptest::prop_assert_eq!(taken.len() as u64, n);
                        for b in &taken {
                            proptest::prop_assert!(model.remove(b), "block {} was not free", b);
                        }
                        if let Op::Runs(_) = o {
                            // From as few runs as any choice could be.
                            let mut lens: Vec<u64> = runs_before.iter().map(|r| r.1).collect();
                            lens.sort_unstable_by(|a, b| b.cmp(a));
                            let fewest = lens.iter().scan(0, |sum, l| {
                                let short = *sum < n;
                                *sum += l;
                                Some(short)
                            }).filter(|&short| short).count();
                            let touched = runs_before.iter().filter(|r| taken.iter().any(|&b| b >= r.0 && b < r.0 + r.1)).count();
                            proptest::prop_assert_eq!(touched, fewest);
                        }
                    }
                    Op::Put(blocks) => {
                        let blocks: BTreeSet<u64> = blocks.into_iter().map(u64::from).filter(|b| !model.contains(b)).collect();
                        free.put(blocks.iter().copied());
                        model.extend(blocks);
                    }
                }
                proptest::prop_assert_eq!(free.len(), model.len() as u64);
                for (i, w) in free.words.iter().enumerate() {
                    proptest::prop_assert_eq!(free.summary[i / 64] >> (i % 64) & 1 == 1, *w != 0);
                }
                for (j, s) in free.summary.iter().enumerate() {
                    proptest::prop_assert_eq!(free.top[j / 64] >> (j % 64) & 1 == 1, *s != 0);
                }
                let runs: Vec<u64> = free.runs().flat_map(|(b, n)| b..b + n).collect();
                proptest::prop_assert_eq!(runs, model.iter().copied().collect::<Vec<_>>());
            }
        }
    }
}
