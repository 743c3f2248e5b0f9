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
//! Superblock layout (little-endian): magic (16 bytes), version (u32: 3; snapshots of
//! version 2, from before values had checksums, load without them, and those of version
//! 1 without deadlines too), state (u32: 0 taken, 1 saved at a clean stop, 2 saved by a
//! checkpoint), block size (u64), capacity (u64),
//! snapshot length (u64), snapshot CRC32c (u32), run count (u32), the header's CRC32c
//! (u32, computed with this field zero), 4 bytes reserved, then the snapshot's runs
//! (first block, count: u64 each).

use super::index::{Extents, Index, Run, SnapshotFields};
use crc32c::crc32c;

const MAGIC: &[u8; 16] = b"dpuflow-kvcache\0";
const VERSION: u32 = 3;
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
        VERSION => (true, true),
        _ => return None,
    };
    Some(SnapshotFields {
        deadlines,
        checksums,
    })
}

/// A superblock's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The layout its snapshot was written in.
    pub version: u32,
    pub saved: Saved,
    pub block_size: u64,
    pub capacity: u64,
    pub snapshot_len: u64,
    pub snapshot_crc: u32,
    pub runs: Vec<Run>,
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
    /// the index was taken at the last start and not saved since (the service did not stop
    /// cleanly)
    #[error("the last run did not stop cleanly")]
    NotClean,
    /// the service's blocks or capacity changed
    #[error(
        "saved with block size {block_size} and capacity {capacity}; the service now has others"
    )]
    OtherStore { block_size: u64, capacity: u64 },
    /// the snapshot does not match its checksum or does not fit the store
    #[error("the saved index is damaged")]
    Snapshot,
}

impl Superblock {
    /// The superblock's bytes, `len` long (one block); `None` when its runs do not fit.
    pub fn encode(&self, len: usize) -> Option<Vec<u8>> {
        let mut b = vec![0u8; len];
        let end = HEADER_LEN.checked_add(self.runs.len().checked_mul(16)?)?;
        if end > len {
            return None;
        }
        b[..16].copy_from_slice(MAGIC);
        b[16..20].copy_from_slice(&self.version.to_le_bytes());
        b[20..24].copy_from_slice(&(self.saved as u32).to_le_bytes());
        b[24..32].copy_from_slice(&self.block_size.to_le_bytes());
        b[32..40].copy_from_slice(&self.capacity.to_le_bytes());
        b[40..48].copy_from_slice(&self.snapshot_len.to_le_bytes());
        b[48..52].copy_from_slice(&self.snapshot_crc.to_le_bytes());
        b[52..56].copy_from_slice(&(self.runs.len() as u32).to_le_bytes());
        for (i, (first, n)) in self.runs.iter().enumerate() {
            let at = HEADER_LEN + 16 * i;
            b[at..at + 8].copy_from_slice(&first.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&n.to_le_bytes());
        }
        let crc = crc32c(&b[..end]);
        b[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
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
        let version = u32_at(16);
        if fields_of(version).is_none() {
            return Err(Unusable::Damaged);
        }
        let runs = u32_at(52) as usize;
        let end = HEADER_LEN + 16 * runs;
        if end > b.len() {
            return Err(Unusable::Damaged);
        }
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
        Ok(Superblock {
            version,
            saved,
            block_size: u64_at(24),
            capacity: u64_at(32),
            snapshot_len: u64_at(40),
            snapshot_crc: u32_at(48),
            runs: (0..runs)
                .map(|i| (u64_at(HEADER_LEN + 16 * i), u64_at(HEADER_LEN + 16 * i + 8)))
                .collect(),
        })
    }

    /// The superblock's bytes once its index has been taken: the same, marked not clean.
    pub fn taken(block: &[u8]) -> Vec<u8> {
        let mut b = block.to_vec();
        if b.len() >= HEADER_LEN {
            b[20..24].copy_from_slice(&0u32.to_le_bytes());
            let end = (HEADER_LEN + 16 * u32::from_le_bytes([b[52], b[53], b[54], b[55]]) as usize)
                .min(b.len());
            b[HEADER_CRC_AT..HEADER_CRC_AT + 4].fill(0);
            let crc = crc32c(&b[..end]);
            b[HEADER_CRC_AT..HEADER_CRC_AT + 4].copy_from_slice(&crc.to_le_bytes());
        }
        b
    }
}

/// What saving needs: the snapshot's bytes, the blocks they go to (held until the process
/// ends), and the superblock that names them.
#[derive(Debug)]
pub struct Save {
    pub snapshot: Vec<u8>,
    pub blocks: Extents,
    pub superblock: Vec<u8>,
}

/// Prepares saving `index` for a store of `capacity` at a clean stop: blocks for its
/// snapshot, from the longest runs of free blocks (the runs are named in the superblock),
/// evicting the least recently used keys if the store is full, as any value would (the
/// snapshot is then taken again, so it describes the keys that remain), and the
/// superblock.
pub fn prepare(index: &mut Index, capacity: u64) -> Option<Save> {
    let block_size = index.block_size();
    let snapshot = index.snapshot();
    if let Some(blocks) = index.take_free(snapshot.len() as u64) {
        return seal(snapshot, blocks, block_size, capacity, Saved::AtStop);
    }
    let keys = index.stats().keys;
    let blocks = index.allocate(b"", snapshot.len() as u64).ok()?;
    // Keys went to make room: the snapshot is only shorter.
    let snapshot = match index.stats().keys == keys {
        true => snapshot,
        false => index.snapshot(),
    };
    seal(snapshot, blocks, block_size, capacity, Saved::AtStop)
}

/// The save of `snapshot` into `blocks` (for a checkpoint: free blocks taken with the
/// index locked, the snapshot encoded after); `None` when the blocks' runs do not fit in
/// the superblock.
pub fn seal(
    mut snapshot: Vec<u8>,
    blocks: Extents,
    block_size: u64,
    capacity: u64,
    saved: Saved,
) -> Option<Save> {
    // Padded to the blocks: the target reads and writes whole sectors.
    let len = snapshot.len() as u64;
    snapshot.resize(
        (blocks.runs().map(|r| r.1).sum::<u64>() * block_size) as usize,
        0,
    );
    let superblock = Superblock {
        version: VERSION,
        saved,
        block_size,
        capacity,
        snapshot_len: len,
        snapshot_crc: crc32c(&snapshot[..len as usize]),
        runs: blocks.runs().collect(),
    }
    .encode(block_size as usize)?;
    Some(Save {
        snapshot,
        blocks,
        superblock,
    })
}

/// The index a superblock and its snapshot's bytes (read from its runs) describe, for a
/// store of `capacity` in blocks of `block_size`.
pub fn load(
    sb: &Superblock,
    snapshot: &[u8],
    capacity: u64,
    block_size: u64,
) -> Result<Index, Unusable> {
    if sb.block_size != block_size || sb.capacity != capacity {
        return Err(Unusable::OtherStore {
            block_size: sb.block_size,
            capacity: sb.capacity,
        });
    }
    let bytes = usize::try_from(sb.snapshot_len)
        .ok()
        .and_then(|n| snapshot.get(..n))
        .ok_or(Unusable::Snapshot)?;
    if crc32c(bytes) != sb.snapshot_crc {
        return Err(Unusable::Snapshot);
    }
    let fields = fields_of(sb.version).ok_or(Unusable::Snapshot)?;
    Index::restore(capacity, block_size, bytes, fields).ok_or(Unusable::Snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_saved_index_loads_once() {
        let (capacity, bs) = (16 * 512, 512);
        let mut ix = Index::new(capacity, bs);
        for (k, len) in [("a", 700u64), ("b", 0), ("c", 512)] {
            let e = ix.allocate(k.as_bytes(), len).unwrap();
            ix.insert(k.as_bytes(), e);
        }
        let save = prepare(&mut ix, capacity).unwrap();
        // The snapshot's blocks are free blocks, not a key's.
        assert_eq!(save.blocks.runs().collect::<Vec<_>>(), [(4, 1)]);
        let sb = Superblock::decode(&save.superblock).unwrap();
        let back = load(&sb, &save.snapshot, capacity, bs).unwrap();
        assert_eq!(back.snapshot(), ix.snapshot());
        assert_eq!(
            Superblock::decode(&Superblock::taken(&save.superblock)),
            Err(Unusable::NotClean)
        );
        assert!(matches!(
            load(&sb, &save.snapshot, capacity * 2, bs),
            Err(Unusable::OtherStore { .. })
        ));
        let mut bad = save.snapshot.clone();
        bad[9] ^= 1;
        assert_eq!(
            load(&sb, &bad, capacity, bs).err(),
            Some(Unusable::Snapshot)
        );
        let mut bad = save.superblock.clone();
        bad[33] ^= 1;
        assert_eq!(Superblock::decode(&bad), Err(Unusable::Damaged));
        assert_eq!(Superblock::decode(&[0; 512]), Err(Unusable::Missing));
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
        let save = prepare(&mut ix, capacity).expect("saved");
        let runs: Vec<_> = save.blocks.runs().collect();
        assert_eq!(runs.len(), 1, "{runs:?}");
        let sb = Superblock::decode(&save.superblock).unwrap();
        let back = load(&sb, &save.snapshot, capacity, bs).unwrap();
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
        let save = prepare(&mut ix, capacity).unwrap();
        let back = load(
            &Superblock::decode(&save.superblock).unwrap(),
            &save.snapshot,
            capacity,
            bs,
        )
        .unwrap();
        assert_eq!(back.stats().keys, 2, "the least recently used made room");
        assert!(!back.contains(b"a"));
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
