//! The index across restarts. A service saves its index (an [`Index::snapshot`]) into
//! free blocks of the target and, in the target's first block, a superblock naming them:
//! when it stops cleanly, and with `checkpoint` every so often while it runs; the next
//! start on the same target, with the same capacity and block size, reads it back.
//!
//! A save stays true while the service writes because the blocks it names are not
//! rewritten until a later save is durable: the blocks of values removed since are held
//! back ([`Index::hold_back`]), and the snapshot's own blocks are kept. A service that
//! saves no checkpoints holds nothing back, so it marks the superblock taken as it loads
//! it, before any value is written: after a crash it starts empty, which a cache can
//! afford, rather than trust an index its blocks may have outgrown.
//!
//! A checkpoint writes the whole index only now and then: in between, a delta of the keys
//! changed since the save before ([`super::index::SnapshotDraft`]), which the superblock
//! names after the snapshot it applies to and the deltas before it. A load applies them in
//! order.
//!
//! Superblock layout (little-endian): magic (16 bytes), version (u32: 4; snapshots of
//! version 3 have no deltas, those of version 2, from before values had checksums, load
//! without them, and those of version 1 without deadlines too), state (u32: 0 taken, 1
//! saved at a clean stop, 2 saved by a checkpoint), block size (u64), capacity (u64),
//! snapshot length (u64), snapshot CRC32c (u32), run count (u32), the header's CRC32c
//! (u32, computed with this field zero, over the whole superblock up to its last delta),
//! the number of targets the store is striped over (u16; 0 in saves from before striping,
//! read as 1) and the blocks of a stripe (u16; 0 on one target), then the snapshot's runs (first block, count: u64 each); from
//! version 4, the delta count (u32), then per delta its length (u64), CRC32c (u32), run
//! count (u32) and runs.

use super::index::{Extents, Index, Run, SnapshotFields};
use crc32c::crc32c;

const MAGIC: &[u8; 16] = b"dpuflow-kvcache\0";
const VERSION: u32 = 4;
/// The first version whose superblock names deltas.
const DELTAS: u32 = 4;
/// When a save was made: its superblock's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    /// At a clean stop.
    AtStop = 1,
    /// By a checkpoint, while the service ran.
    Checkpoint = 2,
}
const HEADER_LEN: usize = 64;
const HEADER_CRC_AT: usize = 56;

/// What the snapshot of a superblock of `version` holds for each key; `None` for a version
/// this build does not know.
fn fields_of(version: u32) -> Option<SnapshotFields> {
    let (deadlines, checksums) = match version {
        1 => (false, false),
        2 => (true, false),
        3 | VERSION => (true, true),
        _ => return None,
    };
    Some(SnapshotFields {
        deadlines,
        checksums,
    })
}

/// What a saved index's block numbers mean: a start reads an index only into a store laid
/// out the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub block_size: u64,
    /// Bytes of the store, over all its targets.
    pub capacity: u64,
    /// How many targets the store is striped over (1: one target).
    pub targets: u16,
    /// Blocks of a stripe, the store's bytes one target takes before the next; 0 on one
    /// target.
    pub stripe_blocks: u16,
}

impl Layout {
    /// The layout of one target's store.
    pub fn single(capacity: u64, block_size: u64) -> Layout {
        Layout {
            block_size,
            capacity,
            targets: 1,
            stripe_blocks: 0,
        }
    }

    /// The layout a service's configuration gives its store.
    pub fn of(config: &crate::ir::KvCache) -> Layout {
        match config.targets.len() {
            0 | 1 => Layout::single(config.capacity, config.block_size),
            n => Layout {
                targets: u16::try_from(n).unwrap_or(u16::MAX),
                stripe_blocks: u16::try_from(config.stripe / config.block_size).unwrap_or(u16::MAX),
                ..Layout::single(config.capacity, config.block_size)
            },
        }
    }

    /// The stripes `extents`' blocks lie in, each as the target that holds it (a target
    /// may come more than once; as many stripes in a row as there are targets touch every
    /// target, so a run names no more).
    fn targets_of<'a>(&self, extents: &'a Extents) -> impl Iterator<Item = usize> + 'a {
        let n = u64::from(self.targets.max(1));
        let stripe = u64::from(self.stripe_blocks.max(1));
        extents.runs().flat_map(move |(first, count)| {
            let (from, to) = (first / stripe, (first + count - 1) / stripe);
            (from..=to.min(from + n - 1)).map(move |s| (s % n) as usize)
        })
    }
}

/// How many values a start reads back from each target of a striped store.
const SAMPLES: usize = 3;

/// The targets of a striped store, laid out as `layout`, that do not hold what `index`
/// (just loaded) says they do: another store's drive, or a blank one, put in the place of
/// one of its targets. The superblock on the first target vouches for that one; each of
/// the others is tried on the smallest of its values (at most three) that lie on it
/// and on targets already vouched for only, and is a stranger when none of them matches
/// its checksum. `matches` reads a value back and says whether it matches (`None`: it
/// could not be read, which proves nothing). A target none of whose values can be tried
/// that way (only values that also lie on targets in doubt) is given the benefit of the
/// doubt: its values are still checked as they are read.
pub fn strangers(
    index: &Index,
    layout: &Layout,
    mut matches: impl FnMut(&Extents) -> Option<bool>,
) -> Vec<usize> {
    #[derive(Clone, Copy, PartialEq)]
    enum Known {
        Trusted,
        Stranger,
        InDoubt,
    }
    let n = usize::from(layout.targets);
    if n < 2 {
        return Vec::new();
    }
    let mut known = vec![Known::InDoubt; n];
    known[0] = Known::Trusted;
    let mut progress = true;
    while progress {
        progress = false;
        for t in 1..n {
            if known[t] != Known::InDoubt {
                continue;
            }
            let mut samples: Vec<&Extents> = Vec::with_capacity(SAMPLES + 1);
            for e in index.values() {
                if e.checksum().is_none() || e.inline().is_some() {
                    continue;
                }
                let (mut on_t, mut on_doubt) = (false, false);
                for i in layout.targets_of(e) {
                    on_t |= i == t;
                    on_doubt |= i != t && known[i] != Known::Trusted;
                }
                let tried = on_t && !on_doubt;
                if tried {
                    let at = samples.partition_point(|s| s.len() <= e.len());
                    samples.insert(at, e);
                    samples.truncate(SAMPLES);
                }
            }
            let read: Vec<bool> = samples.into_iter().filter_map(&mut matches).collect();
            if !read.is_empty() {
                known[t] = if read.contains(&true) {
                    Known::Trusted
                } else {
                    Known::Stranger
                };
                progress = true;
            }
        }
    }
    (1..n).filter(|&t| known[t] == Known::Stranger).collect()
}

/// Whether `extents` has a block on one of the `targets` (flags, one for each target) of a
/// store laid out as `layout`.
pub fn lies_on(layout: &Layout, extents: &Extents, targets: &[bool]) -> bool {
    layout.targets_of(extents).any(|t| targets[t])
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "block size {} and capacity {}",
            self.block_size, self.capacity
        )?;
        if self.targets > 1 {
            write!(
                f,
                " over {} targets in stripes of {} blocks",
                self.targets, self.stripe_blocks
            )?;
        }
        Ok(())
    }
}

/// A superblock's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The layout its snapshot was written in.
    pub version: u32,
    pub saved: Saved,
    /// The store it was saved in.
    pub layout: Layout,
    pub snapshot: Segment,
    /// The deltas to apply to the snapshot, in order.
    pub deltas: Vec<Segment>,
}

/// A snapshot or a delta on the target: its length, checksum and blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub len: u64,
    pub crc: u32,
    pub runs: Vec<Run>,
}

/// Appends `runs` to `b`, each its first block and count.
fn put_runs(b: &mut Vec<u8>, runs: &[Run]) {
    for (first, n) in runs {
        b.extend_from_slice(&first.to_le_bytes());
        b.extend_from_slice(&n.to_le_bytes());
    }
}

/// Where the part of superblock `b` (of `version`) that its checksum covers ends, its
/// `runs` runs included; `None` when it does not fit in `b`.
fn covered(b: &[u8], version: u32, runs: usize) -> Option<usize> {
    let mut end = HEADER_LEN.checked_add(runs.checked_mul(16)?)?;
    if version >= DELTAS {
        let count = u32::from_le_bytes(b.get(end..end + 4)?.try_into().ok()?);
        end += 4;
        for _ in 0..count {
            let n = u32::from_le_bytes(b.get(end + 12..end + 16)?.try_into().ok()?);
            end = end
                .checked_add(16)?
                .checked_add((n as usize).checked_mul(16)?)?;
        }
    }
    (end <= b.len()).then_some(end)
}

/// Why a target's superblock gives no index.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// no superblock: a fresh target, or one used by something else
    #[error("no saved index on the target")]
    Missing,
    /// the superblock is damaged
    #[error("the saved index's superblock is damaged")]
    Damaged,
    /// the superblock is in a format later than this build's: a newer build saved it, and
    /// this one (a rollback) cannot read it
    #[error("saved by a newer dpuflow (index format {version}; this build reads formats 1 to {VERSION})")]
    Newer { version: u32 },
    /// the index was taken at the last start and not saved since (the service did not stop
    /// cleanly)
    #[error("the last run did not stop cleanly")]
    NotClean,
    /// the service's blocks, capacity or targets changed
    #[error("saved with {saved}; the service now has others")]
    OtherStore { saved: Layout },
    /// the snapshot does not match its checksum or does not fit the store
    #[error("the saved index is damaged")]
    Snapshot,
}

impl Superblock {
    /// Whether its snapshot and deltas are in this build's layout, so that a delta of this
    /// build's may follow them.
    pub fn is_current(&self) -> bool {
        self.version == VERSION
    }

    /// The superblock's bytes, `len` long (one block); `None` when its runs do not fit.
    pub fn encode(&self, len: usize) -> Option<Vec<u8>> {
        let mut b = vec![0u8; HEADER_LEN];
        b[..16].copy_from_slice(MAGIC);
        b[16..20].copy_from_slice(&self.version.to_le_bytes());
        b[20..24].copy_from_slice(&(self.saved as u32).to_le_bytes());
        b[24..32].copy_from_slice(&self.layout.block_size.to_le_bytes());
        b[32..40].copy_from_slice(&self.layout.capacity.to_le_bytes());
        b[60..62].copy_from_slice(&self.layout.targets.to_le_bytes());
        b[62..64].copy_from_slice(&self.layout.stripe_blocks.to_le_bytes());
        b[40..48].copy_from_slice(&self.snapshot.len.to_le_bytes());
        b[48..52].copy_from_slice(&self.snapshot.crc.to_le_bytes());
        b[52..56].copy_from_slice(&(self.snapshot.runs.len() as u32).to_le_bytes());
        put_runs(&mut b, &self.snapshot.runs);
        b.extend_from_slice(&(self.deltas.len() as u32).to_le_bytes());
        for d in &self.deltas {
            b.extend_from_slice(&d.len.to_le_bytes());
            b.extend_from_slice(&d.crc.to_le_bytes());
            b.extend_from_slice(&(d.runs.len() as u32).to_le_bytes());
            put_runs(&mut b, &d.runs);
        }
        if b.len() > len {
            return None;
        }
        let crc = crc32c(&b);
        b[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        b.resize(len, 0);
        Some(b)
    }

    /// The superblock in `b` (the target's first block), if it holds a clean one.
    pub fn decode(b: &[u8]) -> Result<Superblock, Unusable> {
        if b.len() < HEADER_LEN || &b[..16] != MAGIC {
            return Err(Unusable::Missing);
        }
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let u64_at = |at: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(x)
        };
        let runs_at = |at: usize, n: usize| -> Vec<Run> {
            (0..n)
                .map(|i| (u64_at(at + 16 * i), u64_at(at + 16 * i + 8)))
                .collect()
        };
        let version = u32_at(16);
        if version > VERSION {
            return Err(Unusable::Newer { version });
        }
        if fields_of(version).is_none() {
            return Err(Unusable::Damaged);
        }
        let runs = u32_at(52) as usize;
        let end = covered(b, version, runs).ok_or(Unusable::Damaged)?;
        let mut header = b[..end].to_vec();
        header[HEADER_CRC_AT..HEADER_CRC_AT + 4].fill(0);
        if crc32c(&header) != u32_at(HEADER_CRC_AT) {
            return Err(Unusable::Damaged);
        }
        let saved = match u32_at(20) {
            1 => Saved::AtStop,
            2 => Saved::Checkpoint,
            _ => return Err(Unusable::NotClean),
        };
        let u16_at = |at: usize| u16::from_le_bytes([b[at], b[at + 1]]);
        Ok(Superblock {
            version,
            saved,
            layout: Layout {
                block_size: u64_at(24),
                capacity: u64_at(32),
                targets: u16_at(60).max(1),
                stripe_blocks: u16_at(62),
            },
            snapshot: Segment {
                len: u64_at(40),
                crc: u32_at(48),
                runs: runs_at(HEADER_LEN, runs),
            },
            deltas: match version >= DELTAS {
                true => {
                    let mut at = HEADER_LEN + 16 * runs + 4;
                    (0..u32_at(at - 4))
                        .map(|_| {
                            let n = u32_at(at + 12) as usize;
                            let d = Segment {
                                len: u64_at(at),
                                crc: u32_at(at + 8),
                                runs: runs_at(at + 16, n),
                            };
                            at += 16 + 16 * n;
                            d
                        })
                        .collect()
                }
                false => Vec::new(),
            },
        })
    }

    /// The snapshot, then each delta.
    pub fn segments(&self) -> impl Iterator<Item = &Segment> {
        std::iter::once(&self.snapshot).chain(&self.deltas)
    }

    /// The superblock's bytes once its index has been taken: the same, marked not clean.
    pub fn taken(block: &[u8]) -> Vec<u8> {
        let mut b = block.to_vec();
        if b.len() >= HEADER_LEN {
            b[20..24].copy_from_slice(&0u32.to_le_bytes());
            let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let end = covered(&b, word(16), word(52) as usize).unwrap_or(b.len());
            b[HEADER_CRC_AT..HEADER_CRC_AT + 4].fill(0);
            let crc = crc32c(&b[..end]);
            b[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        }
        b
    }
}

/// What saving needs: the snapshot's (or delta's) bytes, the blocks they go to (held until
/// the process ends), and the superblock that names them, as bytes and as facts.
#[derive(Debug)]
pub struct Save {
    pub snapshot: Vec<u8>,
    pub blocks: Extents,
    pub superblock: Vec<u8>,
    pub names: Superblock,
}

/// Prepares saving `index` for a store of `capacity` at a clean stop: blocks for its
/// snapshot, from the longest runs of free blocks (the runs are named in the superblock),
/// evicting the least recently used keys if the store is full, as any value would (the
/// snapshot is then taken again, so it describes the keys that remain), and the
/// superblock.
pub fn prepare(index: &mut Index, layout: &Layout) -> Option<Save> {
    let snapshot = index.snapshot();
    if let Some(blocks) = index.take_free(snapshot.len() as u64) {
        return seal(snapshot, blocks, layout, Saved::AtStop);
    }
    let keys = index.stats().keys;
    let blocks = index.allocate(b"", snapshot.len() as u64).ok()?;
    // Keys went to make room: the snapshot is only shorter.
    let snapshot = match index.stats().keys == keys {
        true => snapshot,
        false => index.snapshot(),
    };
    seal(snapshot, blocks, layout, Saved::AtStop)
}

/// `bytes` padded to `blocks` of `block_size` (the target reads and writes whole
/// sectors), as the superblock names them.
fn pad(bytes: &mut Vec<u8>, blocks: &Extents, block_size: u64) -> Segment {
    let segment = Segment {
        len: bytes.len() as u64,
        crc: crc32c(bytes),
        runs: blocks.runs().collect(),
    };
    bytes.resize(
        (segment.runs.iter().map(|r| r.1).sum::<u64>() * block_size) as usize,
        0,
    );
    segment
}

/// The save of `snapshot` into `blocks` (for a checkpoint: free blocks taken with the
/// index locked, the snapshot encoded after); `None` when the blocks' runs do not fit in
/// the superblock.
pub fn seal(mut snapshot: Vec<u8>, blocks: Extents, layout: &Layout, saved: Saved) -> Option<Save> {
    let names = Superblock {
        version: VERSION,
        saved,
        layout: *layout,
        snapshot: pad(&mut snapshot, &blocks, layout.block_size),
        deltas: Vec::new(),
    };
    Some(Save {
        superblock: names.encode(layout.block_size as usize)?,
        names,
        snapshot,
        blocks,
    })
}

/// The save of a checkpoint's `delta` into `blocks`, to be applied after what `last` (the
/// durable superblock) names; `None` when the superblock has no room for its runs.
pub fn seal_delta(last: &Superblock, mut delta: Vec<u8>, blocks: Extents) -> Option<Save> {
    let mut names = Superblock {
        saved: Saved::Checkpoint,
        ..last.clone()
    };
    names
        .deltas
        .push(pad(&mut delta, &blocks, last.layout.block_size));
    Some(Save {
        superblock: names.encode(last.layout.block_size as usize)?,
        names,
        snapshot: delta,
        blocks,
    })
}

/// The bytes `segment` names among those read from its runs, if their CRC32C is its.
fn checked<'a>(read: &'a [u8], segment: &Segment) -> Result<&'a [u8], Unusable> {
    usize::try_from(segment.len)
        .ok()
        .and_then(|n| read.get(..n))
        .filter(|bytes| crc32c(bytes) == segment.crc)
        .ok_or(Unusable::Snapshot)
}

/// The index a superblock, its snapshot's bytes and its deltas' (each read from its
/// runs) describe, for a store laid out as `layout`.
pub fn load(
    sb: &Superblock,
    snapshot: &[u8],
    deltas: &[&[u8]],
    layout: &Layout,
) -> Result<Index, Unusable> {
    if sb.layout != *layout {
        return Err(Unusable::OtherStore { saved: sb.layout });
    }
    let bytes = checked(snapshot, &sb.snapshot)?;
    let fields = fields_of(sb.version).ok_or(Unusable::Snapshot)?;
    let mut index = Index::restore(layout.capacity, layout.block_size, bytes, fields)
        .ok_or(Unusable::Snapshot)?;
    if deltas.len() != sb.deltas.len() {
        return Err(Unusable::Snapshot);
    }
    for (read, d) in deltas.iter().zip(&sb.deltas) {
        let bytes = checked(read, d)?;
        index.apply_delta(bytes, fields).ok_or(Unusable::Snapshot)?;
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An index of a store of 4 KiB blocks striped over `targets` in stripes of 4 blocks,
    /// holding values of `blocks` blocks each (allocated in order from block 1, the first
    /// being the superblock's), checksummed.
    fn striped_index(targets: u16, values: u64, blocks: u64) -> (Index, Layout) {
        let layout = Layout {
            block_size: 4096,
            capacity: 4096 * 256,
            targets,
            stripe_blocks: 4,
        };
        let mut index = Index::new(layout.capacity, layout.block_size);
        for v in 0..values {
            let key = format!("k{v}");
            let mut e = index.allocate(key.as_bytes(), blocks * 4096).unwrap();
            e.set_checksum(v as u32);
            index.insert(key.as_bytes(), e);
        }
        (index, layout)
    }

    /// Values read back as they would be with target `swapped` replaced: one with a block
    /// on it fails its checksum. Counts the reads.
    fn reading(
        layout: Layout,
        swapped: usize,
        reads: &mut usize,
    ) -> impl FnMut(&Extents) -> Option<bool> + '_ {
        move |e| {
            *reads += 1;
            let mut on = vec![false; usize::from(layout.targets)];
            on[swapped] = true;
            Some(!lies_on(&layout, e, &on))
        }
    }

    #[test]
    fn a_replaced_target_is_found_by_the_values_on_it_alone() {
        // Values of one block: each on one target.
        let (index, layout) = striped_index(3, 40, 1);
        for swapped in [1, 2] {
            let mut reads = 0;
            let found = strangers(&index, &layout, reading(layout, swapped, &mut reads));
            assert_eq!(found, [swapped]);
            // A few values from each target past the first, no more.
            assert_eq!(reads, 2 * SAMPLES);
        }
        // The first target is vouched for by its superblock: nothing read says otherwise.
        let mut reads = 0;
        assert!(strangers(&index, &layout, reading(layout, 0, &mut reads)).is_empty());
    }

    #[test]
    fn values_over_several_targets_are_tried_once_the_others_are_vouched_for() {
        // Values of five blocks (a stripe is four) lie on two targets each: target 2's
        // values all share a target with 1 or 0, tried once 1 is known.
        let (index, layout) = striped_index(3, 30, 5);
        let mut reads = 0;
        assert_eq!(
            strangers(&index, &layout, reading(layout, 2, &mut reads)),
            [2]
        );
        // With target 1 a stranger, target 2's values that also lie on 1 prove nothing
        // of 2 and are not tried: those on 0 and 2 are, and vouch for it.
        let mut reads = 0;
        assert_eq!(
            strangers(&index, &layout, reading(layout, 1, &mut reads)),
            [1]
        );
    }

    #[test]
    fn only_a_target_whose_values_all_fail_is_a_stranger() {
        let (index, layout) = striped_index(2, 40, 1);
        // Values that cannot be read prove nothing.
        assert!(strangers(&index, &layout, |_| None).is_empty());
        // One value of the three matching: the target is the store's (the others are
        // found corrupt when read, one by one).
        let mut n = 0;
        let some_match = |_: &Extents| {
            n += 1;
            Some(n == 2)
        };
        assert!(strangers(&index, &layout, some_match).is_empty());
        // A store on one target, or values without checksums (saved by an older build):
        // nothing to try.
        let (one, single) = striped_index(1, 10, 1);
        assert!(strangers(&one, &single, |_| Some(false)).is_empty());
        let mut old = Index::new(layout.capacity, layout.block_size);
        let e = old.allocate(b"k", 4096).unwrap();
        old.insert(b"k", e);
        assert!(strangers(&old, &layout, |_| Some(false)).is_empty());
    }

    #[test]
    fn a_saved_index_loads_once() {
        let (capacity, bs) = (16 * 512, 512);
        let mut ix = Index::new(capacity, bs);
        for (k, len) in [("a", 700u64), ("b", 0), ("c", 512)] {
            let e = ix.allocate(k.as_bytes(), len).unwrap();
            ix.insert(k.as_bytes(), e);
        }
        let save = prepare(&mut ix, &Layout::single(capacity, bs)).unwrap();
        // The snapshot's blocks are free blocks, not a key's.
        assert_eq!(save.blocks.runs().collect::<Vec<_>>(), [(4, 1)]);
        let sb = Superblock::decode(&save.superblock).unwrap();
        let back = load(&sb, &save.snapshot, &[], &Layout::single(capacity, bs)).unwrap();
        assert_eq!(back.snapshot(), ix.snapshot());
        assert_eq!(
            Superblock::decode(&Superblock::taken(&save.superblock)),
            Err(Unusable::NotClean)
        );
        assert!(matches!(
            load(&sb, &save.snapshot, &[], &Layout::single(capacity * 2, bs)),
            Err(Unusable::OtherStore { .. })
        ));
        // The same blocks striped over targets are another store, and each layout is
        // read back as it was written.
        let striped = Layout {
            targets: 2,
            stripe_blocks: 4,
            ..Layout::single(capacity, bs)
        };
        assert_eq!(
            load(&sb, &save.snapshot, &[], &striped).err(),
            Some(Unusable::OtherStore {
                saved: Layout::single(capacity, bs)
            })
        );
        let mut ix = back;
        let on_two = prepare(&mut ix, &striped).unwrap();
        let on_two_sb = Superblock::decode(&on_two.superblock).unwrap();
        assert_eq!(on_two_sb.layout, striped);
        assert!(load(&on_two_sb, &on_two.snapshot, &[], &striped).is_ok());
        // A save from before striping has zeros where the targets go: one target.
        let mut old = save.superblock.clone();
        assert_eq!(&old[60..64], &[1, 0, 0, 0]);
        old[60] = 0;
        old[HEADER_CRC_AT..HEADER_CRC_AT + 4].fill(0);
        let crc = crc32c(&old[..covered(&old, VERSION, 1).unwrap()]);
        old[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            Superblock::decode(&old).unwrap().layout,
            Layout::single(capacity, bs)
        );
        let mut bad = save.snapshot.clone();
        bad[9] ^= 1;
        assert_eq!(
            load(&sb, &bad, &[], &Layout::single(capacity, bs)).err(),
            Some(Unusable::Snapshot)
        );
        let mut bad = save.superblock.clone();
        bad[33] ^= 1;
        assert_eq!(Superblock::decode(&bad), Err(Unusable::Damaged));
        assert_eq!(Superblock::decode(&[0; 512]), Err(Unusable::Missing));
        // A later format is not taken for damage: its layout is unknown, so is its checksum.
        let mut newer = save.superblock.clone();
        newer[16..20].copy_from_slice(&(VERSION + 1).to_le_bytes());
        assert_eq!(
            Superblock::decode(&newer),
            Err(Unusable::Newer {
                version: VERSION + 1
            })
        );
        assert_eq!(
            Unusable::Newer { version: 5 }.to_string(),
            "saved by a newer dpuflow (index format 5; this build reads formats 1 to 4)"
        );
        newer[16..20].fill(0);
        assert_eq!(Superblock::decode(&newer), Err(Unusable::Damaged));
    }

    /// Once keys have churned, free blocks are scattered: the snapshot takes the longest
    /// runs of free blocks, so a superblock can name them.
    #[test]
    fn a_churned_store_saves_its_snapshot_in_few_runs() {
        let (capacity, bs) = (20_000 * 512, 512);
        let mut ix = Index::new(capacity, bs);
        for i in 0..6_000u32 {
            let e = ix.allocate(&i.to_le_bytes(), 1).unwrap();
            ix.insert(&i.to_le_bytes(), e);
        }
        // Every other key deleted: 3,000 single free blocks before the rest in one run.
        for i in (0..6_000u32).step_by(2) {
            ix.remove(&i.to_le_bytes());
        }
        let save = prepare(&mut ix, &Layout::single(capacity, bs)).expect("saved");
        let runs: Vec<_> = save.blocks.runs().collect();
        assert_eq!(runs.len(), 1, "{runs:?}");
        let sb = Superblock::decode(&save.superblock).unwrap();
        let back = load(&sb, &save.snapshot, &[], &Layout::single(capacity, bs)).unwrap();
        assert_eq!(back.snapshot(), ix.snapshot());
    }

    #[test]
    fn a_full_store_evicts_for_its_snapshot() {
        let (capacity, bs) = (4 * 512, 512);
        let mut ix = Index::new(capacity, bs);
        for k in ["a", "b", "c"] {
            let e = ix.allocate(k.as_bytes(), 512).unwrap();
            ix.insert(k.as_bytes(), e);
        }
        let save = prepare(&mut ix, &Layout::single(capacity, bs)).unwrap();
        let back = load(
            &Superblock::decode(&save.superblock).unwrap(),
            &save.snapshot,
            &[],
            &Layout::single(capacity, bs),
        )
        .unwrap();
        assert_eq!(back.stats().keys, 2, "the least recently used made room");
        assert!(!back.contains(b"a"));
    }

    /// A key's value: its length, blocks, checksum and deadline.
    type Value = (u64, Vec<Run>, Option<u32>, Option<u64>);

    /// The value of `key` in `ix`.
    fn value(ix: &mut Index, key: &str) -> Option<Value> {
        let deadline = ix.deadline(key.as_bytes())?;
        let e = ix.get(key.as_bytes())?;
        Some((e.len(), e.runs().collect(), e.checksum(), deadline))
    }

    /// A checkpoint's delta of the keys changed since `changed` was taken, sealed after
    /// what `last` names.
    fn delta(ix: &mut Index, last: &Superblock) -> Save {
        let held = ix.begin_save();
        let changed = ix.take_changed();
        assert!(changed.complete);
        let mut draft = ix.start_delta(changed.keys);
        assert!(ix.snapshot_part(&mut draft, usize::MAX));
        let bytes = draft.encode();
        let blocks = ix.take_free(bytes.len() as u64).unwrap();
        ix.release(held);
        seal_delta(last, bytes, blocks).unwrap()
    }

    /// A snapshot and the deltas after it load as the index they were saved from, and
    /// only with every delta intact; a superblock of version 3, which names no deltas,
    /// still loads.
    #[test]
    fn a_snapshot_and_its_deltas_load_in_order() {
        let (capacity, bs) = (64 * 512, 512);
        let mut ix = Index::new(capacity, bs);
        ix.hold_back(8);
        let put = |ix: &mut Index, k: &str, len: u64| {
            let mut e = ix.allocate(k.as_bytes(), len).unwrap();
            e.set_checksum(len as u32);
            ix.insert(k.as_bytes(), e);
        };
        for (k, len) in [("a", 700), ("b", 512), ("c", 100)] {
            put(&mut ix, k, len);
        }
        let held = ix.begin_save();
        assert!(!ix.take_changed().complete, "the first save is whole");
        let snapshot = ix.snapshot();
        let blocks = ix.take_free(snapshot.len() as u64).unwrap();
        let base = seal(
            snapshot,
            blocks,
            &Layout::single(capacity, bs),
            Saved::Checkpoint,
        )
        .unwrap();
        ix.release(held);
        put(&mut ix, "b", 1500);
        ix.remove(b"c");
        put(&mut ix, "d", 10);
        let first = delta(&mut ix, &base.names);
        ix.set_deadline(b"a", Some(5_000));
        let second = delta(&mut ix, &first.names);
        let sb = Superblock::decode(&second.superblock).unwrap();
        assert_eq!(sb.deltas.len(), 2);
        assert_eq!(sb.snapshot.runs, base.names.snapshot.runs);
        let deltas = [&first.snapshot[..], &second.snapshot[..]];
        let mut back = load(&sb, &base.snapshot, &deltas, &Layout::single(capacity, bs)).unwrap();
        assert_eq!(back.stats().keys, 3);
        for k in ["a", "b", "c", "d"] {
            assert_eq!(value(&mut back, k), value(&mut ix, k), "{k}");
        }
        assert_eq!(value(&mut back, "a").unwrap().3, Some(5_000));
        // Each delta is needed, and must be as written.
        assert_eq!(
            load(
                &sb,
                &base.snapshot,
                &deltas[..1],
                &Layout::single(capacity, bs)
            )
            .err(),
            Some(Unusable::Snapshot)
        );
        let mut bad = first.snapshot.clone();
        bad[3] ^= 1;
        let damaged = [&bad[..], &second.snapshot[..]];
        assert_eq!(
            load(&sb, &base.snapshot, &damaged, &Layout::single(capacity, bs)).err(),
            Some(Unusable::Snapshot)
        );
        // Version 3: the runs and nothing after them under the checksum.
        let mut v3 = base.superblock.clone();
        v3[16..20].copy_from_slice(&3u32.to_le_bytes());
        v3[HEADER_CRC_AT..HEADER_CRC_AT + 4].fill(0);
        let end = HEADER_LEN + 16 * base.names.snapshot.runs.len();
        let crc = crc32c(&v3[..end]);
        v3[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        let old = Superblock::decode(&v3).unwrap();
        assert!(old.deltas.is_empty());
        let back = load(&old, &base.snapshot, &[], &Layout::single(capacity, bs)).unwrap();
        assert_eq!(back.stats().keys, 3);
    }

    proptest! {
        /// Any first block: a superblock or a reason, never a panic.
        #[test]
        fn any_block_decodes_or_is_refused(
            mut b in proptest::collection::vec(any::<u8>(), 0..600),
            magic in any::<bool>(),
        ) {
            if magic && b.len() >= 16 {
                b[..16].copy_from_slice(MAGIC);
            }
            let _ = Superblock::decode(&b);
            let _ = Superblock::taken(&b);
        }
    }
}
