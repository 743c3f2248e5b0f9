//! The block index: which storage blocks hold each key's value, which blocks are free, and
//! which key goes first when room is needed (least recently used, as a cache should).
//!
//! Keys may have a deadline (Redis's `EXPIRE`, `SET … EX`): in unix milliseconds, passed
//! in, so the index keeps no clock: [`Index::purge_expired`], which the server calls
//! before each command looks at keys, says what time it is and removes some of the keys
//! past their deadline. Those it leaves (many keys given one deadline expire together,
//! and removing them all at once held every request up) are gone to every lookup from
//! then on, as Redis's expire lazily, and removed when touched, when their blocks are
//! wanted, or by the next purges.
//!
//! Sans-IO: the index hands out and takes back block numbers; the server moves the bytes.
//! A value's blocks are an [`Extents`] behind an `Arc`: a reader holds its own reference
//! while it reads, so blocks of a key that is meanwhile overwritten, deleted or evicted
//! return to the free list only when the last reader is done, never under its feet.

use super::free::FreeSet;
use super::keys::{Keys, WalkStep};
use crate::engine::prefetch::prefetch;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

/// A run of consecutive blocks: first block and count.
pub type Run = (u64, u64);

/// Blocks not holding any value, shared by the index and every [`Extents`]; and blocks
/// held back from use.
#[derive(Debug)]
struct FreeBlocks {
    set: FreeSet,
    /// Blocks freed while a saved index on the target may still name them: kept out of
    /// use until a later save, which cannot name them, is durable (see
    /// [`Index::hold_back`]). `None` while no saved index needs its blocks kept.
    held_back: Option<Vec<u64>>,
    /// Times a value needed held-back blocks before the next save: the saved index may
    /// then name blocks rewritten since (reads of such keys fail their checksum).
    overruns: u64,
    /// Blocks freed and not yet discarded on the target, kept out of use until they are
    /// (see [`Index::discard_freed`]). `None` when the target is not told of freed blocks.
    undiscarded: Option<Vec<u64>>,
    /// Whether the save under way took for its copy blocks only the save before names
    /// ([`Index::take_for_save`]): an overrun should it fail.
    save_took_released: bool,
}

impl FreeBlocks {
    /// Frees `blocks` that no saved index names: to be discarded first, if that is asked.
    fn free(&mut self, blocks: impl IntoIterator<Item = u64>) {
        match &mut self.undiscarded {
            Some(waiting) => waiting.extend(blocks),
            None => self.set.put(blocks),
        }
    }

    /// Makes room for `n` blocks before any key goes: blocks still to be discarded are
    /// used without (a discard only helps the target), then the blocks held back
    /// (evicted, a key's blocks would only be held back too).
    fn make_room(&mut self, n: u64) {
        self.undiscarded_if_short(n);
        if self.set.len() < n {
            if let Some(held) = self.held_back.take_if(|h| !h.is_empty()) {
                self.set.put(held);
                self.overruns += 1;
            }
        }
    }

    /// Short of `n` free blocks, uses those still to be discarded without (a discard
    /// only helps the target).
    fn undiscarded_if_short(&mut self, n: u64) {
        if self.set.len() < n {
            if let Some(waiting) = self.undiscarded.as_mut().filter(|w| !w.is_empty()) {
                self.set.put(std::mem::take(waiting));
            }
        }
    }
}

/// The storage blocks of one value, in order, its length and its checksum, and for a small
/// value its bytes, kept in memory. Its blocks go back to the free list when the last
/// reference is dropped.
#[derive(Debug)]
pub struct Extents {
    blocks: Vec<u64>,
    len: u64,
    checksum: Option<u32>,
    /// The value's bytes, served from memory; written to the blocks only when the index is
    /// saved (a value the saved index does not name is lost in a crash anyway).
    inline: Option<Box<[u8]>>,
    /// Whether the value kept in memory has been written to its blocks (by a save).
    inline_written: AtomicBool,
    free: Arc<Mutex<FreeBlocks>>,
}

impl Extents {
    /// The value's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The CRC32C of the value as it was written; `None` for a value restored from a
    /// snapshot taken before values had checksums.
    pub fn checksum(&self) -> Option<u32> {
        self.checksum
    }

    /// Notes the CRC32C of the value about to be written to these blocks.
    pub fn set_checksum(&mut self, crc: u32) {
        self.checksum = Some(crc);
    }

    /// Keeps the value's bytes in memory (see [`Extents::inline`]).
    pub fn keep_inline(&mut self, value: &[u8]) {
        debug_assert_eq!(value.len() as u64, self.len);
        self.inline = Some(value.into());
    }

    /// The value's bytes, when they are kept in memory rather than read from the target.
    pub fn inline(&self) -> Option<&[u8]> {
        self.inline.as_deref()
    }

    /// Whether the value kept in memory still has to be written to its blocks for a save
    /// to name them.
    pub fn inline_unwritten(&self) -> bool {
        self.inline.is_some() && !self.inline_written.load(Relaxed)
    }

    /// Notes that the value kept in memory is now on its blocks.
    pub fn set_inline_written(&self) {
        self.inline_written.store(true, Relaxed);
    }

    /// How many of the value's bytes are kept in memory.
    fn inline_len(&self) -> u64 {
        self.inline.as_ref().map_or(0, |b| b.len() as u64)
    }

    /// The blocks as runs of consecutive block numbers, in the value's order: one I/O
    /// each.
    pub fn runs(&self) -> impl Iterator<Item = Run> + '_ {
        let mut blocks = self.blocks.iter().copied().peekable();
        std::iter::from_fn(move || {
            let first = blocks.next()?;
            let mut n = 1;
            while blocks.next_if_eq(&(first + n)).is_some() {
                n += 1;
            }
            Some((first, n))
        })
    }
}

impl Drop for Extents {
    fn drop(&mut self) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        match &mut free.held_back {
            Some(held) => held.extend(&self.blocks),
            None => free.free(self.blocks.iter().copied()),
        }
    }
}

/// Why a value cannot be stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// the value is larger than the store
    #[error("the value ({len} bytes) is larger than the store ({capacity} bytes)")]
    TooLarge { len: u64, capacity: u64 },
    /// every block is held by readers
    #[error("no room: the remaining blocks are being read")]
    Busy,
}

#[derive(Debug)]
struct Entry {
    extents: Arc<Extents>,
    /// Its place in the recency order.
    tick: u64,
    /// When it expires (unix milliseconds), if it does.
    deadline: Option<u64>,
}

/// What the index counts, for metrics and INFO.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    pub keys: u64,
    /// Blocks holding values held in the index (blocks still being read after their key
    /// left are not counted here nor free).
    pub used_blocks: u64,
    /// Blocks values may take (the reserved ones not counted).
    pub total_blocks: u64,
    pub evictions: u64,
    /// Keys with a deadline.
    pub expiring: u64,
    /// Keys removed for having passed their deadline.
    pub expired: u64,
    /// Bytes of the values held that are kept in memory (see [`Extents::inline`]).
    pub inline_bytes: u64,
    /// Times values needed blocks held back for the saved index (see
    /// [`Index::hold_back`]).
    pub hold_back_overruns: u64,
}

/// Keys → extents over `total` blocks of `block_size` bytes.
#[derive(Debug)]
pub struct Index {
    map: Keys<Entry>,
    /// Recency: tick → key, oldest first.
    order: BTreeMap<u64, Arc<[u8]>>,
    /// Keys with deadlines, soonest first.
    deadlines: BTreeSet<(u64, Arc<[u8]>)>,
    tick: u64,
    free: Arc<Mutex<FreeBlocks>>,
    block_size: u64,
    total: u64,
    used: u64,
    /// Bytes of the values held kept in memory.
    inline_bytes: u64,
    /// Bytes of the keys held.
    key_bytes: usize,
    evictions: u64,
    expired: u64,
    /// The time (unix milliseconds) the last [`Index::purge_expired`] said: keys whose
    /// deadline is before it are gone, whether removed yet or not.
    now: u64,
    /// Blocks keys may not fill while blocks are held back (see [`Index::hold_back`]):
    /// room for the values written between two saves (besides the saves' own, see
    /// [`Index::kept_free`]).
    reserve: u64,
    /// Changes to the keys, their values or deadlines so far: a save with none since the
    /// last has nothing new to say.
    changes: u64,
    /// The keys changed since the last save began ([`Index::take_changed`]), once per
    /// change (a push: a set would cost each write a hashed insert): what a delta must
    /// say, while `noting`.
    changed: Vec<Arc<[u8]>>,
    /// Whether `changed` has every change: not before the first save, after the store
    /// was emptied, nor once the changes were too many for a delta to be worth it (the
    /// next save is then whole; the keys noted stay until it takes them, as dropping
    /// them is a cache miss each, not for a write to pay).
    noting: bool,
}

/// What a snapshot holds for each key beyond its blocks: older snapshots lack fields later
/// ones have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotFields {
    /// Its deadline.
    pub deadlines: bool,
    /// Its value's checksum.
    pub checksums: bool,
}

impl SnapshotFields {
    /// What [`Index::snapshot`] writes.
    pub const ALL: SnapshotFields = SnapshotFields {
        deadlines: true,
        checksums: true,
    };
}

/// The fixed fields of a key's record in a snapshot: key length, value length, block
/// count, deadline, checksum.
const SNAPSHOT_RECORD: usize = 4 + 8 + 4 + 8 + 8;

/// Keys a checkpoint copies each time it takes the index's lock ([`Index::snapshot_part`]):
/// half a millisecond's work (docs/benchmarks.md, "Checkpoints of the index").
pub const SNAPSHOT_PART: usize = 1024;

/// How far ahead in the recency order a snapshot fetches keys' bytes.
const PREFETCH_KEYS: usize = 8;

/// Changes a delta may hold beyond half the keys held ([`Index::take_changed`]), so that
/// a small store's changes are saved as deltas too.
const DELTA_SLACK: usize = 64;

/// A save's copy of the index, taken a part at a time ([`Index::snapshot_part`]) so that
/// requests need not wait for the whole index: either a whole snapshot
/// ([`Index::start_snapshot`]), each key's record of [`Index::snapshot`] in recency order,
/// or a delta ([`Index::start_delta`]), the keys changed since the save before, to be
/// applied on top of it ([`Index::apply_delta`]).
///
/// Between parts keys change. The copy stays true because the blocks of values removed
/// after it started are held back ([`Index::begin_save`] before the first part). In a
/// whole snapshot a key copied and then deleted is saved as it was, one used again is
/// copied again at its new place in the order (the later copy wins,
/// [`SnapshotDraft::encode`]), one added is copied when the copy reaches the newest keys.
/// A delta copies a fixed set of keys, each as it is when its part comes (a key gone by
/// then is saved as removed); what changes meanwhile is the next delta's to say. Each key
/// is saved as it was at some moment of the copy, as a point-in-time copy would save it
/// had it been taken at that moment.
#[derive(Debug)]
pub struct SnapshotDraft {
    /// The records, one after another.
    records: Vec<u8>,
    /// The values kept in memory that are not on their blocks yet.
    inline_unwritten: Vec<Arc<Extents>>,
    /// Parts copied so far.
    parts: u64,
    /// [`FreeBlocks::overruns`] when the copy started.
    overruns: u64,
    /// Whether values took held-back blocks while the copy was between parts.
    torn: bool,
    kind: DraftKind,
}

/// What a [`SnapshotDraft`] copies.
#[derive(Debug)]
enum DraftKind {
    Whole {
        /// Where each record ends in `records`.
        ends: Vec<usize>,
        /// The recency tick the next part starts at.
        next_tick: u64,
        /// The index's recency tick when the copy started: keys copied at a later one
        /// were used since.
        started: u64,
        /// Records of keys used since the copy started (the last ones).
        used_since: usize,
    },
    Delta {
        /// The keys to copy, a key once for each change.
        keys: Vec<Arc<[u8]>>,
        /// How many of them are copied.
        next: usize,
        /// The keys copied, each once.
        seen: HashSet<Arc<[u8]>>,
        /// Each record's key's recency tick and where the record is in `records`.
        spans: Vec<(u64, Range<usize>)>,
        /// The keys found removed: length (u32) and bytes each.
        removed: Vec<u8>,
        removed_count: u64,
    },
}

impl SnapshotDraft {
    fn new(ix: &Index, records: usize, kind: DraftKind) -> SnapshotDraft {
        SnapshotDraft {
            records: Vec::with_capacity(records),
            inline_unwritten: Vec::new(),
            parts: 0,
            overruns: ix.overruns(),
            torn: false,
            kind,
        }
    }

    /// Parts the copy took.
    pub fn parts(&self) -> u64 {
        self.parts
    }

    /// Whether this is a delta ([`Index::start_delta`]).
    pub fn is_delta(&self) -> bool {
        matches!(self.kind, DraftKind::Delta { .. })
    }

    /// The values kept in memory that must be written before a superblock names the
    /// snapshot.
    pub fn inline_unwritten(&self) -> &[Arc<Extents>] {
        &self.inline_unwritten
    }

    /// Whether values took blocks held back while the copy was between parts (an
    /// overrun, [`Index::hold_back`]): a key copied before may then name blocks another,
    /// copied after, holds, and [`Index::restore`] would refuse the whole snapshot.
    pub fn is_torn(&self) -> bool {
        self.torn
    }

    /// The snapshot's bytes (see [`Index::snapshot`]), of a key copied more than once
    /// only its last copy; or the delta's (see [`Index::apply_delta`]).
    pub fn encode(self) -> Vec<u8> {
        match self.kind {
            DraftKind::Whole {
                ends, used_since, ..
            } => encode_whole(&self.records, &ends, used_since),
            DraftKind::Delta {
                mut spans,
                removed,
                removed_count,
                ..
            } => {
                let mut out = Vec::with_capacity(16 + removed.len() + self.records.len());
                out.extend_from_slice(&removed_count.to_le_bytes());
                out.extend_from_slice(&removed);
                out.extend_from_slice(&(spans.len() as u64).to_le_bytes());
                // From least to most recently used, the order a load gives them.
                spans.sort_unstable_by_key(|(tick, _)| *tick);
                for (_, span) in spans {
                    out.extend_from_slice(&self.records[span]);
                }
                out
            }
        }
    }
}

/// A whole snapshot's bytes from its records, the last `used_since` of them those of keys
/// used since the copy started: of a key copied more than once, only the last copy.
fn encode_whole(records: &[u8], ends: &[usize], used_since: usize) -> Vec<u8> {
    fn key(record: &[u8]) -> &[u8] {
        let len = u32::from_le_bytes(record[..4].try_into().expect("4 bytes")) as usize;
        &record[SNAPSHOT_RECORD..SNAPSHOT_RECORD + len]
    }
    let record = |i: usize| {
        let start = i.checked_sub(1).map_or(0, |p| ends[p]);
        &records[start..ends[i]]
    };
    // Only keys used after the copy started can have been copied twice: the last
    // records, in recency order.
    let first_used = ends.len() - used_since;
    let mut later = HashSet::with_capacity(used_since);
    let mut kept: Vec<usize> = (first_used..ends.len())
        .rev()
        .filter(|&i| later.insert(key(record(i))))
        .collect();
    kept.reverse();
    let mut out = Vec::with_capacity(8 + records.len());
    let earlier = (0..first_used).filter(|&i| later.is_empty() || !later.contains(key(record(i))));
    let count = earlier.clone().count() + kept.len();
    out.extend_from_slice(&(count as u64).to_le_bytes());
    for i in earlier.chain(kept) {
        out.extend_from_slice(record(i));
    }
    out
}

/// Appends `key`'s record (see [`Index::snapshot`]) to `r`.
fn write_record(r: &mut Vec<u8>, key: &[u8], e: &Entry) {
    let x = &e.extents;
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(&x.len.to_le_bytes());
    r.extend_from_slice(&(x.blocks.len() as u32).to_le_bytes());
    r.extend_from_slice(&e.deadline.unwrap_or(0).to_le_bytes());
    let checksum = x.checksum.map_or(0, |c| 1 << 32 | u64::from(c));
    r.extend_from_slice(&checksum.to_le_bytes());
    r.extend_from_slice(key);
    for b in &x.blocks {
        r.extend_from_slice(&b.to_le_bytes());
    }
}

/// The keys changed since a save began ([`Index::take_changed`]).
#[derive(Debug)]
pub struct Changed {
    /// A key once for each change.
    pub keys: Vec<Arc<[u8]>>,
    /// Whether every change is among them: not for the first save, nor after the store
    /// was emptied, nor when the changes outnumbered half the keys held.
    pub complete: bool,
}

/// A key's record read from a snapshot or delta.
struct Record<'a> {
    key: &'a [u8],
    len: u64,
    deadline: Option<u64>,
    checksum: Option<u32>,
    blocks: Vec<u64>,
}

/// Reads `n` bytes off the front of `bytes`.
fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    let (head, rest) = bytes.split_at_checked(n)?;
    *bytes = rest;
    Some(head)
}

fn u32_of(bytes: &mut &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(take(bytes, 4)?.try_into().ok()?))
}

fn u64_of(bytes: &mut &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(take(bytes, 8)?.try_into().ok()?))
}

/// Blocks at the start of the target that never hold values: the superblock
/// ([`super::persist`]).
pub const RESERVED_BLOCKS: u64 = 1;

impl Index {
    /// An empty index of `capacity` bytes (whole blocks only) in blocks of `block_size`,
    /// the first [`RESERVED_BLOCKS`] kept out.
    pub fn new(capacity: u64, block_size: u64) -> Index {
        let block_size = block_size.max(1);
        let total = (capacity / block_size).max(RESERVED_BLOCKS);
        Index {
            map: Keys::new(),
            order: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            tick: 0,
            free: Arc::new(Mutex::new(FreeBlocks {
                set: {
                    let mut set = FreeSet::new(total);
                    set.put(RESERVED_BLOCKS..total);
                    set
                },
                held_back: None,
                overruns: 0,
                undiscarded: None,
                save_took_released: false,
            })),
            block_size,
            total,
            used: 0,
            inline_bytes: 0,
            key_bytes: 0,
            evictions: 0,
            expired: 0,
            now: 0,
            reserve: 0,
            changes: 0,
            changed: Vec::new(),
            noting: false,
        }
    }

    /// The index as bytes, keys from least to most recently used: a count (u64), then per
    /// key its length (u32), its value's length (u64), its block count (u32), its deadline
    /// (u64, 0 for none), its value's checksum (u64: the CRC32C with bit 32 set, 0 for
    /// none), the key and the block numbers (u64 each), all little-endian.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut draft = self.start_snapshot();
        self.snapshot_part(&mut draft, usize::MAX);
        draft.encode()
    }

    /// A copy of the index to be taken in parts ([`Index::snapshot_part`]), for a save
    /// that has called [`Index::begin_save`].
    pub fn start_snapshot(&self) -> SnapshotDraft {
        let estimate = self.map.len() * SNAPSHOT_RECORD + self.key_bytes + 8 * self.used as usize;
        let kind = DraftKind::Whole {
            ends: Vec::with_capacity(self.map.len()),
            next_tick: 0,
            started: self.tick,
            used_since: 0,
        };
        SnapshotDraft::new(self, estimate, kind)
    }

    /// A delta of `changed`, the keys [`Index::take_changed`] gave when this save began
    /// (after [`Index::begin_save`]): to be taken in parts ([`Index::snapshot_part`]) and
    /// applied on top of the save before ([`Index::apply_delta`]).
    pub fn start_delta(&self, changed: Vec<Arc<[u8]>>) -> SnapshotDraft {
        let estimate = changed.len() * (SNAPSHOT_RECORD + 64);
        let kind = DraftKind::Delta {
            keys: changed,
            next: 0,
            seen: HashSet::new(),
            spans: Vec::new(),
            removed: Vec::new(),
            removed_count: 0,
        };
        SnapshotDraft::new(self, estimate, kind)
    }

    /// Copies the records of up to `most` keys into `draft` (of a whole snapshot, the
    /// least recently used not copied yet first); whether the copy is complete (of a
    /// whole snapshot, every key used since it started copied too).
    pub fn snapshot_part(&self, draft: &mut SnapshotDraft, most: usize) -> bool {
        draft.parts += 1;
        let copied = match &mut draft.kind {
            DraftKind::Whole {
                ends,
                next_tick,
                started,
                used_since,
            } => {
                let mut copied = 0;
                let mut ahead = self.order.range(*next_tick..).skip(PREFETCH_KEYS);
                for (&tick, key) in self.order.range(*next_tick..).take(most) {
                    // The key's bytes are hashed next to find its entry: fetched ahead.
                    if let Some(first) = ahead.next().and_then(|(_, k)| k.first()) {
                        prefetch(first);
                    }
                    *next_tick = tick + 1;
                    copied += 1;
                    let Some(e) = self.map.get(key) else {
                        continue;
                    };
                    write_record(&mut draft.records, key, e);
                    ends.push(draft.records.len());
                    *used_since += usize::from(tick > *started);
                    if e.extents.inline_unwritten() {
                        draft.inline_unwritten.push(Arc::clone(&e.extents));
                    }
                }
                copied
            }
            DraftKind::Delta {
                keys,
                next,
                seen,
                spans,
                removed,
                removed_count,
            } => {
                let part = &keys[*next..keys.len().min(next.saturating_add(most))];
                for key in part {
                    if !seen.insert(Arc::clone(key)) {
                        continue;
                    }
                    match self.map.get(key) {
                        Some(e) => {
                            let start = draft.records.len();
                            write_record(&mut draft.records, key, e);
                            spans.push((e.tick, start..draft.records.len()));
                            if e.extents.inline_unwritten() {
                                draft.inline_unwritten.push(Arc::clone(&e.extents));
                            }
                        }
                        None => {
                            removed.extend_from_slice(&(key.len() as u32).to_le_bytes());
                            removed.extend_from_slice(key);
                            *removed_count += 1;
                        }
                    }
                }
                *next += part.len();
                part.len()
            }
        };
        let complete = copied < most;
        if complete {
            draft.torn = draft.parts > 1 && self.overruns() != draft.overruns;
        }
        complete
    }

    /// The index a [`Index::snapshot`] describes, for a store of `capacity` bytes in blocks
    /// of `block_size`; `None` unless every key's blocks are in the store, outside the
    /// reserved ones, held by no other key, and as many as its value needs. `fields` says
    /// what the snapshot holds for each key (keys of older snapshots have no deadlines,
    /// values no checksums).
    pub fn restore(
        capacity: u64,
        block_size: u64,
        mut bytes: &[u8],
        fields: SnapshotFields,
    ) -> Option<Index> {
        let mut ix = Index::new(capacity, block_size);
        let keys = u64_of(&mut bytes)?;
        for _ in 0..keys {
            let record = ix.read_record(&mut bytes, fields)?;
            ix.hold_record(record)?;
        }
        bytes.is_empty().then_some(ix)
    }

    /// Applies a delta ([`Index::start_delta`]) to the index restored from the save it
    /// follows: the keys it names as removed go, and those it has records of then hold
    /// those values (replacing any), as the most recently used in the records' order.
    /// `None` (the index then half changed: to be dropped) when the delta is malformed or
    /// its blocks are not free once the keys it names have let theirs go.
    pub fn apply_delta(&mut self, mut bytes: &[u8], fields: SnapshotFields) -> Option<()> {
        let removed = u64_of(&mut bytes)?;
        for _ in 0..removed {
            let len = u32_of(&mut bytes)? as usize;
            self.remove(take(&mut bytes, len)?);
        }
        let count = u64_of(&mut bytes)?;
        let mut records = Vec::new();
        for _ in 0..count {
            records.push(self.read_record(&mut bytes, fields)?);
        }
        // Every key named lets its old value go before any takes its new blocks: a delta
        // says where its keys end, in no particular order.
        for r in &records {
            self.remove(r.key);
        }
        for r in records {
            self.hold_record(r)?;
        }
        bytes.is_empty().then_some(())
    }

    /// Reads a key's record (see [`Index::snapshot`]) off the front of `bytes`; `None`
    /// when it is cut short or names more or fewer blocks than its value needs (or more
    /// than the store has).
    fn read_record<'a>(&self, bytes: &mut &'a [u8], fields: SnapshotFields) -> Option<Record<'a>> {
        let key_len = u32_of(bytes)? as usize;
        let len = u64_of(bytes)?;
        let n = u32_of(bytes)?;
        let deadline = match fields.deadlines {
            true => Some(u64_of(bytes)?).filter(|&d| d != 0),
            false => None,
        };
        let checksum = match fields.checksums {
            true => match u64_of(bytes)? {
                0 => None,
                c if c >> 32 == 1 => Some(c as u32),
                _ => return None,
            },
            false => None,
        };
        // As many blocks as the value needs, and no more than the store has (before
        // anything is allocated for them).
        if u64::from(n) != len.div_ceil(self.block_size) || u64::from(n) > self.total {
            return None;
        }
        let key = take(bytes, key_len)?;
        let blocks = (0..n)
            .map(|_| u64_of(bytes))
            .collect::<Option<Vec<u64>>>()?;
        Some(Record {
            key,
            len,
            deadline,
            checksum,
            blocks,
        })
    }

    /// Holds a record's key, not held yet, as the most recently used, in the blocks it
    /// names, which must be free.
    fn hold_record(&mut self, r: Record<'_>) -> Option<()> {
        if self.map.contains_key(r.key) {
            return None;
        }
        // Each in the store, not reserved, and not named twice.
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if !free.set.take_these(&r.blocks) {
            return None;
        }
        drop(free);
        let n = r.blocks.len() as u64;
        let extents = Extents {
            blocks: r.blocks,
            len: r.len,
            checksum: r.checksum,
            inline: None,
            inline_written: AtomicBool::new(false),
            free: Arc::clone(&self.free),
        };
        // Not through the free list: the blocks are the snapshot's to give.
        let tick = self.next_tick();
        let key: Arc<[u8]> = Arc::from(r.key);
        self.used += n;
        self.key_bytes += key.len();
        self.order.insert(tick, Arc::clone(&key));
        if let Some(d) = r.deadline {
            self.deadlines.insert((d, Arc::clone(&key)));
        }
        let entry = Entry {
            extents: Arc::new(extents),
            tick,
            deadline: r.deadline,
        };
        self.map.insert(key, entry);
        Some(())
    }

    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// The value of `key`, now its most recently used.
    pub fn get(&mut self, key: &[u8]) -> Option<Arc<Extents>> {
        self.expire_if_due(key);
        let tick = self.next_tick();
        let e = self.map.get_mut(key)?;
        let k = self.order.remove(&e.tick)?;
        e.tick = tick;
        self.order.insert(tick, k);
        Some(Arc::clone(&e.extents))
    }

    /// The values held whose bytes are kept in memory, in no particular order.
    pub fn inline_values(&self) -> Vec<Arc<Extents>> {
        self.map
            .values()
            .filter(|e| e.extents.inline.is_some())
            .map(|e| Arc::clone(&e.extents))
            .collect()
    }

    /// A step of a walk over the keys held in the order of a hash fixed for the index's
    /// life: the `most` with the least hashes at or past `from` (see `Keys::walk`).
    pub fn walk_keys(&self, from: u64, most: usize) -> WalkStep {
        self.map.walk(from, most, |e| !self.past(e))
    }

    /// The keys held of the map `map` of the index's maps; `None` past the last (a walk
    /// over every key a map at a time).
    pub fn keys_of_map(&self, map: usize) -> Option<Vec<Arc<[u8]>>> {
        self.map.keys_of_map(map, |e| !self.past(e))
    }

    /// Every value held, in no particular order (recency unchanged).
    pub fn values(&self) -> impl Iterator<Item = &Extents> {
        self.map.values().map(|e| &*e.extents)
    }

    /// Removes every key that `drop` picks, given it and its value; how many it removed.
    pub fn remove_where(&mut self, mut drop: impl FnMut(&[u8], &Extents) -> bool) -> usize {
        let keys: Vec<Arc<[u8]>> = self
            .map
            .iter()
            .filter(|(k, e)| drop(k, &e.extents))
            .map(|(k, _)| Arc::clone(k))
            .collect();
        for k in &keys {
            self.remove(k);
        }
        keys.len()
    }

    /// The keys held that `pick` picks, given each.
    pub fn keys_where(&self, mut pick: impl FnMut(&[u8]) -> bool) -> Vec<Arc<[u8]>> {
        self.map
            .iter()
            .filter(|(k, e)| !self.past(e) && pick(k))
            .map(|(k, _)| Arc::clone(k))
            .collect()
    }

    /// `key`'s value and deadline, its recency unchanged.
    pub fn peek(&self, key: &[u8]) -> Option<(Arc<Extents>, Option<u64>)> {
        self.live(key).map(|e| (Arc::clone(&e.extents), e.deadline))
    }

    /// Whether `key` is held (its recency unchanged).
    pub fn contains(&self, key: &[u8]) -> bool {
        self.live(key).is_some()
    }

    /// The length of `key`'s value, its recency unchanged.
    pub fn len_of(&self, key: &[u8]) -> Option<u64> {
        self.live(key).map(|e| e.extents.len())
    }

    /// How many blocks `key`'s value takes, its recency unchanged.
    pub fn blocks_of(&self, key: &[u8]) -> Option<usize> {
        self.live(key).map(|e| e.extents.blocks.len())
    }

    /// `key`'s entry, unless its deadline has passed.
    fn live(&self, key: &[u8]) -> Option<&Entry> {
        self.map.get(key).filter(|e| !self.past(e))
    }

    /// Whether `e`'s deadline has passed (it is gone, though maybe not removed yet).
    fn past(&self, e: &Entry) -> bool {
        e.deadline.is_some_and(|d| d < self.now)
    }

    /// Removes `key` if its deadline has passed.
    fn expire_if_due(&mut self, key: &[u8]) {
        if self.map.get(key).is_some_and(|e| self.past(e)) {
            self.expire(key);
        }
    }

    /// Removes the key whose deadline passed first, if one has; whether one had.
    fn expire_first_due(&mut self) -> bool {
        match self.deadlines.first() {
            Some((d, key)) if *d < self.now => {
                let key = Arc::clone(key);
                self.expire(&key);
                true
            }
            _ => false,
        }
    }

    /// Removes `key`, past its deadline, counting it expired.
    fn expire(&mut self, key: &[u8]) {
        self.take(key);
        self.expired += 1;
    }

    /// Keys past their deadline but not removed yet.
    fn past_unremoved(&self) -> u64 {
        self.deadlines
            .iter()
            .take_while(|(d, _)| *d < self.now)
            .count() as u64
    }

    /// Blocks for a value of `len` bytes that will replace `key`'s: short of room, `key`'s
    /// own value goes first, then the least recently used keys until there is room. The
    /// blocks are the caller's until [`Index::insert`]: dropped unused, they return to the
    /// free list.
    pub fn allocate(&mut self, key: &[u8], len: u64) -> Result<Extents, StoreError> {
        self.allocate_replacing(key, len)
            .map(|(extents, _)| extents)
    }

    /// [`Index::allocate`], saying whether `key`'s own value went to make room (the key
    /// is then not held until the caller inserts it again).
    pub fn allocate_replacing(
        &mut self,
        key: &[u8],
        len: u64,
    ) -> Result<(Extents, bool), StoreError> {
        let mut removed = false;
        let n = len.div_ceil(self.block_size);
        let room = self.total - RESERVED_BLOCKS;
        if n > room {
            return Err(StoreError::TooLarge {
                len,
                capacity: room * self.block_size,
            });
        }
        // Keys leave the reserve to the values written before the next save (keys that
        // go are held back until then).
        while self.used + n > room.saturating_sub(self.kept_free()) && !self.map.is_empty() {
            if self.remove(key) {
                removed = true;
            } else if !self.expire_first_due() && !self.evict_oldest() {
                break;
            }
        }
        loop {
            {
                let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
                free.make_room(n);
                if let Some(blocks) = free.set.take(n) {
                    drop(free);
                    return Ok((self.extents_of(blocks, len), removed));
                }
            }
            if self.remove(key) {
                removed = true;
            } else if !self.expire_first_due() && !self.evict_oldest() {
                return Err(StoreError::Busy);
            }
        }
    }

    /// Makes `extents` the value of `key`, replacing any (whose blocks are freed once no
    /// reader holds them).
    pub fn insert(&mut self, key: &[u8], extents: Extents) {
        self.expire_if_due(key);
        // A key held already keeps its string (and its removal counted the change).
        let held = self.take(key);
        let key: Arc<[u8]> = match held {
            Some(key) => key,
            None => {
                let key = Arc::from(key);
                self.note_change(&key);
                key
            }
        };
        let tick = self.next_tick();
        self.used += extents.blocks.len() as u64;
        self.key_bytes += key.len();
        self.inline_bytes += extents.inline_len();
        self.order.insert(tick, Arc::clone(&key));
        self.map.insert(
            key,
            Entry {
                extents: Arc::new(extents),
                tick,
                deadline: None,
            },
        );
    }

    /// Removes `key` if its value is still `extents` (not since replaced); whether it was.
    pub fn remove_value(&mut self, key: &[u8], extents: &Arc<Extents>) -> bool {
        let same = self
            .map
            .get(key)
            .is_some_and(|e| Arc::ptr_eq(&e.extents, extents));
        same && self.remove(key)
    }

    /// Removes `key`; whether it was held (a key past its deadline was not).
    pub fn remove(&mut self, key: &[u8]) -> bool {
        self.expire_if_due(key);
        self.take(key).is_some()
    }

    /// Removes `key`, giving back its string if it was held.
    fn take(&mut self, key: &[u8]) -> Option<Arc<[u8]>> {
        let (k, e) = self.map.remove_entry(key)?;
        self.order.remove(&e.tick);
        self.forget(Arc::clone(&k), &e);
        Some(k)
    }

    /// The blocks and deadline of a removed entry.
    fn forget(&mut self, key: Arc<[u8]>, e: &Entry) {
        self.note_change(&key);
        self.used -= e.extents.blocks.len() as u64;
        self.key_bytes -= key.len();
        self.inline_bytes -= e.extents.inline_len();
        if let Some(d) = e.deadline {
            self.deadlines.remove(&(d, key));
        }
    }

    /// Removes every key.
    pub fn clear(&mut self) {
        self.changes += 1;
        // A delta would name every key: the next save is whole.
        self.noting = false;
        self.map.clear();
        self.order.clear();
        self.deadlines.clear();
        self.used = 0;
        self.key_bytes = 0;
        self.inline_bytes = 0;
    }

    /// `key`'s deadline: `None` when the key is not held, `Some(None)` when it has none.
    pub fn deadline(&self, key: &[u8]) -> Option<Option<u64>> {
        self.live(key).map(|e| e.deadline)
    }

    /// Gives `key` a deadline (unix milliseconds), or takes its away; whether the key is
    /// held.
    pub fn set_deadline(&mut self, key: &[u8], deadline: Option<u64>) -> bool {
        self.expire_if_due(key);
        let Some((k, e)) = self.map.get_key_value(key) else {
            return false;
        };
        let k = Arc::clone(k);
        if let Some(old) = e.deadline {
            self.deadlines.remove(&(old, Arc::clone(&k)));
        }
        if let Some(d) = deadline {
            self.deadlines.insert((d, Arc::clone(&k)));
        }
        if let Some(e) = self.map.get_mut(key) {
            e.deadline = deadline;
        }
        self.note_change(&k);
        true
    }

    /// Says the time is `now` (unix milliseconds): from then on keys whose deadline is
    /// before it are gone (a key expires once its deadline has passed, as in Redis).
    /// Removes up to `most` of them, soonest first; how many it removed.
    pub fn purge_expired(&mut self, now: u64, most: usize) -> u64 {
        self.now = now;
        let mut n = 0;
        while n < most && self.expire_first_due() {
            n += 1;
        }
        n as u64
    }

    pub fn stats(&self) -> IndexStats {
        let past = self.past_unremoved();
        IndexStats {
            keys: self.map.len() as u64 - past,
            used_blocks: self.used,
            total_blocks: (self.total - RESERVED_BLOCKS).saturating_sub(self.kept_free()),
            evictions: self.evictions,
            expiring: self.deadlines.len() as u64 - past,
            expired: self.expired,
            inline_bytes: self.inline_bytes,
            hold_back_overruns: self.overruns(),
        }
    }

    fn overruns(&self) -> u64 {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overruns
    }

    /// Blocks keys leave free while blocks are held back: the reserve for the values
    /// written between two saves, and room for three snapshots of the index as it is (the
    /// one the target names and the deltas on it, kept, at most as large again, and the
    /// next), so a save finds room however full the store.
    fn kept_free(&self) -> u64 {
        if self.reserve == 0 {
            return 0;
        }
        let snapshot = 8
            + SNAPSHOT_RECORD as u64 * self.map.len() as u64
            + self.key_bytes as u64
            + 8 * self.used;
        self.reserve + 3 * snapshot.div_ceil(self.block_size)
    }

    /// Changes to keys, values and deadlines so far (a count that only grows).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Counts a change to `key` and notes the key for the next delta. Past half the keys
    /// held in changes (and a few), a delta would be most of a whole snapshot: the keys
    /// are then forgotten and the next save is whole.
    fn note_change(&mut self, key: &Arc<[u8]>) {
        self.changes += 1;
        if self.noting {
            if self.changed.len() >= self.map.len() / 2 + DELTA_SLACK {
                self.noting = false;
            } else {
                self.changed.push(Arc::clone(key));
            }
        }
    }

    /// The keys changed since the last call, for a save beginning; changes are noted
    /// afresh from now. Best dropped with the index unlocked: they may be many.
    pub fn take_changed(&mut self) -> Changed {
        Changed {
            keys: std::mem::take(&mut self.changed),
            complete: std::mem::replace(&mut self.noting, true),
        }
    }

    /// Keeps the blocks of values removed from now on out of use, as a saved index on the
    /// target may name them (values written meanwhile take other blocks), until
    /// [`Index::release`] says a later save is durable; keys leave `reserve` blocks free
    /// for those values. Should they need more before the next save (an overrun), the
    /// blocks held back are used after all, and the saved index may name blocks since
    /// rewritten: its keys' checksums then fail, and they read as misses.
    pub fn hold_back(&mut self, reserve: u64) {
        self.reserve = reserve.min(self.total - RESERVED_BLOCKS);
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.held_back.get_or_insert_with(Vec::new);
    }

    /// The blocks held back so far, for a save about to be taken: it cannot name them, so
    /// once it is durable they are free ([`Index::release`]); if it fails, the index saved
    /// before may still name them ([`Index::hold_again`]). Blocks freed from now on are
    /// held back for the new save.
    pub fn begin_save(&mut self) -> Vec<u64> {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.held_back.replace(Vec::new()).unwrap_or_default()
    }

    /// Frees blocks [`Index::begin_save`] gave, once the save is durable.
    pub fn release(&mut self, blocks: Vec<u64>) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.save_took_released = false;
        free.free(blocks);
    }

    /// Holds back again blocks [`Index::begin_save`] gave, the save having failed (or frees
    /// them, if an overrun has stopped holding back since). A save that had taken some of
    /// them for its copy ([`Index::take_for_save`]) leaves the save before naming blocks
    /// perhaps rewritten since: an overrun.
    pub fn hold_again(&mut self, blocks: Vec<u64>) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if std::mem::take(&mut free.save_took_released) {
            free.overruns += 1;
        }
        match &mut free.held_back {
            Some(held) => held.extend(blocks),
            None => free.free(blocks),
        }
    }

    /// From now on blocks freed are kept out of use until
    /// [`Index::discarded`] gives them back, so the target can be told they no longer hold
    /// data before anything is written to them again.
    pub fn discard_freed(&mut self) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.undiscarded.get_or_insert_with(Vec::new);
    }

    /// The blocks freed since the last call, as runs, for the target to discard; they stay
    /// out of use until [`Index::discarded`] (unless values need them first).
    pub fn take_undiscarded(&mut self) -> Vec<Run> {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let mut blocks = free
            .undiscarded
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        drop(free);
        blocks.sort_unstable();
        let mut runs: Vec<Run> = Vec::new();
        for b in blocks {
            match runs.last_mut() {
                Some((first, n)) if *first + *n == b => *n += 1,
                _ => runs.push((b, 1)),
            }
        }
        runs
    }

    /// Frees the runs [`Index::take_undiscarded`] gave, discarded or not.
    pub fn discarded(&mut self, runs: &[Run]) {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.set.put(runs.iter().flat_map(|&(b, n)| b..b + n));
    }

    /// Free blocks for `len` bytes that are no key's value (a save's snapshot), from the
    /// longest runs of free blocks; `None` when there are not enough, evicting nothing.
    pub fn take_free(&mut self, len: u64) -> Option<Extents> {
        let n = len.div_ceil(self.block_size);
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        let blocks = free.set.take_longest_runs(n)?;
        drop(free);
        Some(self.extents_of(blocks, len))
    }

    /// Blocks for `len` bytes of a save's snapshot or delta (no key's value), from the
    /// longest runs of free blocks; short of them, blocks still to be discarded, then
    /// `released`, the blocks [`Index::begin_save`] gave this save (only the save before
    /// names them; this one frees them). Keys leave room for the save
    /// (see `Index::kept_free`), but values take free blocks first and leave that room in
    /// the blocks held back: a full store that goes quiet would otherwise never save
    /// again. Only the blocks this save takes leave `released` (values never get them
    /// before it is durable); should it fail (or the service crash while it is written),
    /// the one before may name blocks since rewritten, an overrun ([`Index::hold_again`]
    /// counts it). `None` when even they are too few, evicting nothing.
    pub fn take_for_save(&mut self, len: u64, released: &mut Vec<u64>) -> Option<Extents> {
        let n = len.div_ceil(self.block_size);
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        free.undiscarded_if_short(n);
        let blocks = if free.set.len() < n && !released.is_empty() {
            free.set.put(released.iter().copied());
            let blocks = free.set.take_longest_runs(n);
            let taken: HashSet<u64> = blocks.iter().flatten().copied().collect();
            let before = released.len();
            released.retain(|b| !taken.contains(b));
            free.save_took_released = released.len() < before;
            // Just put there and not taken: all still free.
            let back = free.set.take_these(released);
            debug_assert!(back);
            blocks
        } else {
            free.set.take_longest_runs(n)
        }?;
        drop(free);
        Some(self.extents_of(blocks, len))
    }

    /// The given runs of blocks, taken out of the free list, as one value that is no
    /// key's (a loaded snapshot's, kept while the target's superblock names them); `None`
    /// if any of them is not free.
    pub fn take_runs(&mut self, runs: &[Run]) -> Option<Extents> {
        let blocks: Vec<u64> = runs.iter().flat_map(|&(b, n)| b..b + n).collect();
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if !free.set.take_these(&blocks) {
            return None;
        }
        drop(free);
        let len = blocks.len() as u64 * self.block_size;
        Some(self.extents_of(blocks, len))
    }

    /// `blocks`, taken from the free list, as the blocks of `len` bytes: back to it (or held
    /// back) when dropped.
    fn extents_of(&self, blocks: Vec<u64>, len: u64) -> Extents {
        Extents {
            blocks,
            len,
            checksum: None,
            inline: None,
            inline_written: AtomicBool::new(false),
            free: Arc::clone(&self.free),
        }
    }

    fn evict_oldest(&mut self) -> bool {
        let Some((_, key)) = self.order.pop_first() else {
            return false;
        };
        if let Some(e) = self.map.remove(&key) {
            self.forget(key, &e);
        }
        self.evictions += 1;
        true
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn put(ix: &mut Index, key: &str, len: u64) -> Result<(), StoreError> {
        let e = ix.allocate(key.as_bytes(), len)?;
        ix.insert(key.as_bytes(), e);
        Ok(())
    }

    fn blocks_of(ix: &mut Index, key: &str) -> Vec<u64> {
        ix.get(key.as_bytes()).expect("held").blocks.clone()
    }

    #[test]
    fn blocks_held_back_are_used_again_only_once_a_later_save_is_durable() {
        let mut ix = Index::new(32 * 512, 512);
        ix.hold_back(4);
        put(&mut ix, "a", 3 * 512).unwrap();
        let a = blocks_of(&mut ix, "a");
        // Saved with `a`; then `a` goes and another value comes.
        assert!(ix.begin_save().is_empty());
        ix.remove(b"a");
        put(&mut ix, "b", 3 * 512).unwrap();
        assert!(blocks_of(&mut ix, "b").iter().all(|b| !a.contains(b)));
        // A save that failed leaves them held back; one that is durable frees them.
        let held = ix.begin_save();
        assert_eq!(held, a);
        ix.hold_again(held);
        let held = ix.begin_save();
        assert_eq!(held, a);
        ix.release(held);
        put(&mut ix, "c", 3 * 512).unwrap();
        assert_eq!(blocks_of(&mut ix, "c"), a);
        assert_eq!(ix.stats().hold_back_overruns, 0);
    }

    #[test]
    fn keys_leave_the_reserve_free_and_a_store_short_of_it_overruns_the_hold_back() {
        // 16 blocks for values; while holding back, 4 of them kept free for values and 3
        // for snapshots (one block each, at most, here).
        let mut ix = Index::new(17 * 4096, 4096);
        ix.hold_back(4);
        assert_eq!(ix.stats().total_blocks, 9);
        for i in 0..9 {
            put(&mut ix, &format!("k{i}"), 4096).unwrap();
        }
        // Each one more evicts the oldest (held back) and takes a free block.
        for i in 9..16 {
            put(&mut ix, &format!("k{i}"), 4096).unwrap();
            assert_eq!(ix.stats().keys, 9);
        }
        assert_eq!(ix.stats().hold_back_overruns, 0);
        assert!(!ix.contains(b"k6") && ix.contains(b"k7"));
        // The room kept for snapshots is in the blocks held back now: a save takes what
        // it needs of those it frees, as values would.
        let mut released = ix.begin_save();
        assert_eq!(released.len(), 7);
        assert!(ix.take_free(4096).is_none());
        let snapshot = ix.take_for_save(4096, &mut released).expect("room");
        assert_eq!(released.len(), 6);
        // It failed: the save before may name a block rewritten since.
        assert_eq!(ix.stats().hold_back_overruns, 0);
        ix.hold_again(released);
        assert_eq!(ix.stats().hold_back_overruns, 1);
        drop(snapshot);
        // The next is durable; the one after finds room in the blocks it freed.
        let mut released = ix.begin_save();
        assert_eq!(released.len(), 7);
        let snapshot = ix.take_for_save(4096, &mut released).expect("room");
        ix.release(released);
        let mut released = ix.begin_save();
        assert!(released.is_empty());
        let next = ix.take_for_save(4096, &mut released).expect("room");
        ix.release(released);
        assert_eq!(ix.stats().hold_back_overruns, 1);
        drop((snapshot, next));
        // No free block left before a save: the held-back blocks are used after all
        // rather than every key evicted.
        for i in 16..21 {
            put(&mut ix, &format!("k{i}"), 4096).unwrap();
            assert_eq!(ix.stats().hold_back_overruns, 1);
        }
        put(&mut ix, "k21", 4096).unwrap();
        assert_eq!(ix.stats().keys, 9);
        assert_eq!(ix.stats().hold_back_overruns, 2);
        // Holding back stopped until the next save.
        ix.remove(b"k21");
        assert!(ix.begin_save().is_empty());
    }

    /// Keys leave room for the snapshots too, so a full store of small blocks (where the
    /// index takes more than the reserve) still saves.
    #[test]
    fn a_full_store_of_small_blocks_has_room_for_its_snapshot() {
        let mut ix = Index::new(1001 * 512, 512);
        ix.hold_back(1000 / 16);
        for i in 0..2000u32 {
            put(&mut ix, &format!("key{i}"), 512).unwrap();
        }
        let len = ix.snapshot().len() as u64;
        assert!(
            len > 62 * 512,
            "the snapshot ({len} bytes) outgrows the reserve"
        );
        let blocks = ix.take_free(len).expect("room for the snapshot");
        let held = ix.begin_save();
        ix.release(held);
        drop(blocks);
    }

    #[test]
    fn freed_blocks_wait_to_be_discarded_unless_values_need_them() {
        let mut ix = Index::new(room(8, 512), 512);
        ix.discard_freed();
        put(&mut ix, "a", 3 * 512).unwrap();
        put(&mut ix, "b", 512).unwrap();
        put(&mut ix, "c", 2 * 512).unwrap();
        ix.remove(b"a");
        ix.remove(b"c");
        let free = || ix.free.lock().unwrap().set.len();
        assert_eq!(free(), 2, "a's and c's blocks are not free until discarded");
        let runs = ix.take_undiscarded();
        assert_eq!(runs, [(1, 3), (5, 2)]);
        assert!(ix.take_undiscarded().is_empty());
        ix.discarded(&runs);
        assert_eq!(ix.free.lock().unwrap().set.len(), 7);
        // A value short of free blocks takes the ones still to be discarded before
        // evicting a key.
        put(&mut ix, "d", 7 * 512).unwrap();
        ix.remove(b"d");
        put(&mut ix, "e", 7 * 512).unwrap();
        assert!(ix.contains(b"b") && ix.contains(b"e"));
        assert!(ix.take_undiscarded().is_empty());
    }

    #[test]
    fn a_saved_snapshots_runs_are_taken_only_when_all_free() {
        let mut ix = Index::new(16 * 512, 512);
        put(&mut ix, "a", 512).unwrap();
        let free = ix.free.lock().unwrap().set.len();
        assert!(ix.take_runs(&[(1, 2)]).is_none(), "block 1 is a's");
        assert_eq!(ix.free.lock().unwrap().set.len(), free);
        let kept = ix.take_runs(&[(5, 2), (9, 1)]).expect("free");
        assert_eq!(kept.blocks, [5, 6, 9]);
        assert_eq!(ix.free.lock().unwrap().set.len(), free - 3);
        drop(kept);
        assert_eq!(ix.free.lock().unwrap().set.len(), free);
    }

    /// Room for `n` blocks of values, the reserved ones besides.
    fn room(n: u64, block: u64) -> u64 {
        (n + RESERVED_BLOCKS) * block
    }

    #[test]
    fn values_take_whole_blocks_in_runs() {
        let mut ix = Index::new(room(10, 4096), 4096);
        put(&mut ix, "a", 1).unwrap();
        put(&mut ix, "b", 3 * 4096).unwrap();
        put(&mut ix, "empty", 0).unwrap();
        // Block 0 is the superblock's.
        assert_eq!(ix.get(b"a").unwrap().runs().collect::<Vec<_>>(), [(1, 1)]);
        assert_eq!(ix.get(b"b").unwrap().runs().collect::<Vec<_>>(), [(2, 3)]);
        assert_eq!(ix.get(b"empty").unwrap().runs().collect::<Vec<_>>(), []);
        assert_eq!(ix.stats().used_blocks, 4);
        assert_eq!(
            ix.allocate(b"c", 11 * 4096).unwrap_err(),
            StoreError::TooLarge {
                len: 11 * 4096,
                capacity: 10 * 4096
            }
        );
    }

    #[test]
    fn least_recently_used_goes_first() {
        let mut ix = Index::new(room(3, 512), 512);
        for k in ["a", "b", "c"] {
            put(&mut ix, k, 512).unwrap();
        }
        ix.get(b"a");
        put(&mut ix, "d", 512).unwrap();
        assert!(!ix.contains(b"b"), "b was least recently used");
        assert!(ix.contains(b"a") && ix.contains(b"c") && ix.contains(b"d"));
        put(&mut ix, "e", 1024).unwrap();
        assert!(!ix.contains(b"c") && !ix.contains(b"a"));
        let s = ix.stats();
        assert_eq!((s.keys, s.used_blocks, s.evictions), (2, 3, 3));
    }

    #[test]
    fn blocks_being_read_are_not_reused() {
        let mut ix = Index::new(room(2, 512), 512);
        put(&mut ix, "a", 1024).unwrap();
        let reading = ix.get(b"a").unwrap();
        put(&mut ix, "a", 512).unwrap_err();
        // The failed put gave up "a" itself; its blocks wait for the reader.
        assert!(!ix.contains(b"a"));
        assert_eq!(ix.stats().evictions, 0);
        assert_eq!(ix.allocate(b"b", 512).unwrap_err(), StoreError::Busy);
        drop(reading);
        put(&mut ix, "b", 1024).unwrap();
        assert_eq!(ix.get(b"b").unwrap().runs().collect::<Vec<_>>(), [(1, 2)]);
    }

    #[test]
    fn overwrite_and_remove_free_blocks() {
        let mut ix = Index::new(room(4, 512), 512);
        put(&mut ix, "a", 2048).unwrap();
        put(&mut ix, "a", 512).unwrap();
        assert_eq!(ix.stats().used_blocks, 1);
        assert!(ix.remove(b"a"));
        assert!(!ix.remove(b"a"));
        put(&mut ix, "b", 2048).unwrap();
        ix.clear();
        assert_eq!(
            ix.stats(),
            IndexStats {
                total_blocks: 4,
                ..IndexStats::default()
            }
        );
        put(&mut ix, "c", 2048).unwrap();
    }

    #[test]
    fn a_snapshot_restores_keys_blocks_and_recency() {
        let mut ix = Index::new(room(8, 512), 512);
        put(&mut ix, "a", 1000).unwrap();
        put(&mut ix, "b", 1).unwrap();
        put(&mut ix, "c", 0).unwrap();
        put(&mut ix, "a", 1500).unwrap();
        ix.get(b"b");
        // Least recently used first: c, a, b.
        let snap = ix.snapshot();
        let mut back = Index::restore(room(8, 512), 512, &snap, SnapshotFields::ALL).unwrap();
        assert_eq!(back.snapshot(), snap);
        assert_eq!(back.stats().used_blocks, ix.stats().used_blocks);
        for k in [&b"a"[..], b"b", b"c"] {
            assert_eq!(
                back.get(k).unwrap().runs().collect::<Vec<_>>(),
                ix.get(k).unwrap().runs().collect::<Vec<_>>()
            );
        }
        // The free blocks are exactly those no key holds (4 of 8), and recency is as it
        // was: filling the store evicts c (no blocks), then a, and keeps b.
        let mut back = Index::restore(room(8, 512), 512, &snap, SnapshotFields::ALL).unwrap();
        put(&mut back, "d", 4 * 512).unwrap();
        assert_eq!(back.stats().evictions, 0);
        put(&mut back, "e", 512).unwrap();
        assert!(!back.contains(b"c") && !back.contains(b"a") && back.contains(b"b"));
    }

    #[test]
    fn a_snapshot_that_does_not_fit_the_store_is_refused() {
        let mut ix = Index::new(room(8, 512), 512);
        put(&mut ix, "a", 1024).unwrap();
        let snap = ix.snapshot();
        assert!(Index::restore(room(8, 512), 512, &snap, SnapshotFields::ALL).is_some());
        assert!(
            Index::restore(room(1, 512), 512, &snap, SnapshotFields::ALL).is_none(),
            "blocks past the end"
        );
        assert!(
            Index::restore(room(8, 512), 1024, &snap, SnapshotFields::ALL).is_none(),
            "another block size"
        );
        assert!(Index::restore(
            room(8, 512),
            512,
            &snap[..snap.len() - 1],
            SnapshotFields::ALL
        )
        .is_none());
        let mut extra = snap.clone();
        extra.push(0);
        assert!(Index::restore(room(8, 512), 512, &extra, SnapshotFields::ALL).is_none());
        // Two keys claiming one block; a key on the superblock.
        let mut twice = snap.clone();
        twice[0] = 2;
        twice.extend_from_slice(&snap[8..]);
        assert!(Index::restore(room(8, 512), 512, &twice, SnapshotFields::ALL).is_none());
        let mut reserved = snap.clone();
        let at = reserved.len() - 16;
        reserved[at..at + 8].copy_from_slice(&0u64.to_le_bytes());
        assert!(Index::restore(room(8, 512), 512, &reserved, SnapshotFields::ALL).is_none());
    }

    proptest::proptest! {
        /// Any bytes: a snapshot or `None`, never a panic.
        #[test]
        fn any_bytes_restore_or_are_refused(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200)) {
            for (deadlines, checksums) in [(false, false), (true, false), (true, true)] {
                let fields = SnapshotFields { deadlines, checksums };
                let _ = Index::restore(room(8, 512), 512, &bytes, fields);
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Put(u8, u16),
        Deadline(u8, Option<u16>),
        Remove(u8),
        /// The time, and the most keys past their deadline to remove.
        Purge(u16, usize),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (0..8u8, 0..3000u16).prop_map(|(k, len)| Op::Put(k, len)),
            (0..8u8, proptest::option::of(0..100u16)).prop_map(|(k, d)| Op::Deadline(k, d)),
            (0..8u8).prop_map(Op::Remove),
            (0..120u16, 0..3usize).prop_map(|(now, most)| Op::Purge(now, most)),
        ]
    }

    proptest::proptest! {
        /// Against a map of keys to (length, deadline), with room for every key (no
        /// eviction), the time only going forward and purges removing at most two keys
        /// past their deadline: the keys, their deadlines and the count of keys with one
        /// agree after every step (keys past their deadline are gone whether removed or
        /// not); and once every key past its deadline is removed, the blocks in use and
        /// the expired count.
        #[test]
        fn deadlines_agree_with_a_model(ops in proptest::collection::vec(op(), 1..60)) {
            let mut ix = Index::new(room(8 * 6, 512), 512);
            let mut model: HashMap<u8, (u64, Option<u64>)> = HashMap::new();
            let (mut expired, mut now) = (0, 0);
            for o in ops {
                match o {
                    Op::Put(k, len) => {
                        put(&mut ix, &k.to_string(), u64::from(len)).unwrap();
                        model.insert(k, (u64::from(len), None));
                    }
                    Op::Deadline(k, d) => {
                        let d = d.map(u64::from);
                        let held = model.get_mut(&k).map(|e| e.1 = d).is_some();
                        proptest::prop_assert_eq!(ix.set_deadline(k.to_string().as_bytes(), d), held);
                    }
                    Op::Remove(k) => {
                        proptest::prop_assert_eq!(ix.remove(k.to_string().as_bytes()), model.remove(&k).is_some());
                    }
                    Op::Purge(at, most) => {
                        now = now.max(u64::from(at));
                        ix.purge_expired(now, most);
                    }
                }
                // What the time says is gone: a deadline passed, set now or before.
                let before = model.len();
                model.retain(|_, (_, d)| d.is_none_or(|d| d >= now));
                expired += (before - model.len()) as u64;
                let s = ix.stats();
                proptest::prop_assert_eq!(s.keys, model.len() as u64);
                proptest::prop_assert_eq!(s.expiring, model.values().filter(|e| e.1.is_some()).count() as u64);
                for k in 0..8u8 {
                    let key = k.to_string();
                    let want = model.get(&k);
                    proptest::prop_assert_eq!(ix.deadline(key.as_bytes()), want.map(|e| e.1));
                    proptest::prop_assert_eq!(ix.contains(key.as_bytes()), want.is_some());
                    proptest::prop_assert_eq!(ix.len_of(key.as_bytes()), want.map(|e| e.0));
                }
                let mut keys: Vec<String> = (0..)
                    .map_while(|m| ix.keys_of_map(m))
                    .flatten()
                    .map(|k| String::from_utf8_lossy(&k).into_owned())
                    .collect();
                keys.sort();
                let mut want: Vec<String> = model.keys().map(u8::to_string).collect();
                want.sort();
                proptest::prop_assert_eq!(keys, want);
            }
            ix.purge_expired(now, usize::MAX);
            let s = ix.stats();
            proptest::prop_assert_eq!(s.expired, expired);
            proptest::prop_assert_eq!(s.used_blocks, model.values().map(|e| e.0.div_ceil(512)).sum::<u64>());
        }
    }

    /// A step of a service that takes checkpoints: writes and deletes, with saves begun and
    /// ended (durable or failed) between them.
    #[derive(Debug, Clone)]
    enum SaveOp {
        Put(u8, u8),
        Remove(u8),
        Begin,
        End(bool),
        /// The discarder takes the blocks freed, and then says they are discarded.
        Discard,
        Discarded,
    }

    fn save_op() -> impl proptest::strategy::Strategy<Value = SaveOp> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (0..24u8, 1..5u8).prop_map(|(k, n)| SaveOp::Put(k, n)),
            2 => (0..24u8).prop_map(SaveOp::Remove),
            1 => Just(SaveOp::Begin),
            1 => any::<bool>().prop_map(SaveOp::End),
            1 => Just(SaveOp::Discard),
            1 => Just(SaveOp::Discarded),
        ]
    }

    /// Every block of every key held, and of the snapshot.
    fn named_blocks(ix: &Index, snapshot: &Extents) -> BTreeSet<u64> {
        let mut named = named_blocks_of_keys(ix);
        named.extend(&snapshot.blocks);
        named
    }

    /// Every block of every key held.
    fn named_blocks_of_keys(ix: &Index) -> BTreeSet<u64> {
        ix.map
            .values()
            .flat_map(|e| e.extents.blocks.clone())
            .collect()
    }

    proptest::proptest! {
        /// While no value has needed more than the reserve, no value is written to a block
        /// that the durable save, or one being written, names: a crash at any moment finds
        /// a saved index whose blocks hold what it says. With discards, no block is
        /// discarded that a key, a save or a save being written names, and none is given
        /// to a value while its discard is under way.
        #[test]
        fn no_value_lands_in_a_block_a_save_names(
            ops in proptest::collection::vec(save_op(), 1..120),
            discards in proptest::bool::ANY,
        ) {
            // 64 blocks for values, 8 of them the reserve.
            let mut ix = Index::new(65 * 512, 512);
            ix.hold_back(8);
            if discards {
                ix.discard_freed();
            }
            let mut durable: (BTreeSet<u64>, Option<Extents>) = (BTreeSet::new(), None);
            let mut writing: Option<(Vec<u64>, Extents, BTreeSet<u64>)> = None;
            let mut discarding: Vec<Run> = Vec::new();
            for o in ops {
                match o {
                    SaveOp::Put(k, n) => {
                        let key = [k];
                        let e = ix.allocate(&key, u64::from(n) * 512).unwrap();
                        for b in &e.blocks {
                            let under_way = discarding.iter().any(|&(f, n)| (f..f + n).contains(b));
                            proptest::prop_assert!(!under_way, "block {} given while discarded", b);
                        }
                        if ix.stats().hold_back_overruns == 0 {
                            for b in &e.blocks {
                                proptest::prop_assert!(!durable.0.contains(b), "block {} of the durable save reused", b);
                                let named = writing.as_ref().is_some_and(|w| w.2.contains(b));
                                proptest::prop_assert!(!named, "block {} of the save being written reused", b);
                            }
                        }
                        ix.insert(&key, e);
                    }
                    SaveOp::Remove(k) => {
                        ix.remove(&[k]);
                    }
                    // As a checkpoint: the copy, then blocks for it, from those the
                    // save frees where the free ones are too few.
                    SaveOp::Begin if writing.is_none() => {
                        let mut released = ix.begin_save();
                        let len = ix.snapshot().len() as u64;
                        match ix.take_for_save(len, &mut released) {
                            Some(blocks) => {
                                let named = named_blocks(&ix, &blocks);
                                writing = Some((released, blocks, named));
                            }
                            None => ix.hold_again(released),
                        }
                    }
                    SaveOp::End(durable_now) => {
                        if let Some((released, blocks, named)) = writing.take() {
                            if durable_now {
                                ix.release(released);
                                durable = (named, Some(blocks));
                            } else {
                                ix.hold_again(released);
                            }
                        }
                    }
                    SaveOp::Discard if discarding.is_empty() => {
                        discarding = ix.take_undiscarded();
                        let mut named = named_blocks_of_keys(&ix);
                        if let Some(w) = &writing {
                            named.extend(&w.1.blocks);
                        }
                        // After an overrun the saves may name blocks used since (their
                        // keys then read as misses), and so discarded.
                        if ix.stats().hold_back_overruns == 0 {
                            named.extend(&durable.0);
                            if let Some(w) = &writing {
                                named.extend(&w.2);
                            }
                        }
                        for &(first, n) in &discarding {
                            for b in first..first + n {
                                proptest::prop_assert!(!named.contains(&b), "block {} discarded while named", b);
                            }
                        }
                    }
                    SaveOp::Discarded => {
                        ix.discarded(&std::mem::take(&mut discarding));
                    }
                    SaveOp::Begin | SaveOp::Discard => {}
                }
                // Blocks are never lost: free, held back (or to be freed when the save
                // being written is durable), waiting to be discarded or being discarded,
                // a key's or a snapshot's.
                let free = ix.free.lock().unwrap();
                let held = free.held_back.as_ref().map_or(0, Vec::len)
                    + writing.as_ref().map_or(0, |w| w.0.len())
                    + free.undiscarded.as_ref().map_or(0, Vec::len)
                    + discarding.iter().map(|r| r.1 as usize).sum::<usize>();
                let snapshots = durable.1.as_ref().map_or(0, |e| e.blocks.len())
                    + writing.as_ref().map_or(0, |w| w.1.blocks.len());
                proptest::prop_assert_eq!(
                    free.set.len() as usize + held + ix.used as usize + snapshots,
                    64
                );
            }
        }
    }

    /// A step between two parts of a snapshot's copy.
    #[derive(Debug, Clone)]
    enum CopyOp {
        Put(u8, u8),
        Get(u8),
        Remove(u8),
    }

    /// Values each key had, by its blocks.
    type Had = HashMap<u8, BTreeSet<Vec<u64>>>;

    /// Runs `ops` on `ix`, noting in `had` the values they give keys.
    fn run_copy_ops(ix: &mut Index, had: &mut Had, ops: Vec<CopyOp>) {
        for o in ops {
            match o {
                CopyOp::Put(k, n) => {
                    let e = ix.allocate(&[k], u64::from(n) * 512).unwrap();
                    had.entry(k).or_default().insert(e.blocks.clone());
                    ix.insert(&[k], e);
                }
                CopyOp::Get(k) => drop(ix.get(&[k])),
                CopyOp::Remove(k) => drop(ix.remove(&[k])),
            }
        }
    }

    /// Copies `draft` a part of each step's size at a time, the step's ops run after its
    /// part; once the steps are done, the rest in one part.
    fn copy_in_parts(
        ix: &mut Index,
        draft: &mut SnapshotDraft,
        steps: Vec<(usize, Vec<CopyOp>)>,
        had: &mut Had,
    ) {
        let mut steps = steps.into_iter();
        loop {
            let (most, ops) = steps.next().unwrap_or((usize::MAX, Vec::new()));
            if ix.snapshot_part(draft, most) {
                break;
            }
            run_copy_ops(ix, had, ops);
        }
    }

    fn copy_op() -> impl proptest::strategy::Strategy<Value = CopyOp> {
        use proptest::prelude::*;
        prop_oneof![
            2 => (0..16u8, 1..4u8).prop_map(|(k, n)| CopyOp::Put(k, n)),
            2 => (0..16u8).prop_map(CopyOp::Get),
            1 => (0..16u8).prop_map(CopyOp::Remove),
        ]
    }

    proptest::proptest! {
        /// A snapshot copied a few keys at a time while keys are written, read and deleted
        /// between the parts restores (no block named twice), has every key held when the
        /// copy ends with the value it has then, and any other key with a value it had
        /// during the copy, in blocks no other value has taken.
        #[test]
        fn a_snapshot_copied_in_parts_is_true(
            before in proptest::collection::vec((0..16u8, 1..4u8), 0..16),
            steps in proptest::collection::vec((1..4usize, proptest::collection::vec(copy_op(), 0..4)), 1..40),
        ) {
            // Room for every value written during the copy (at most 40 × 4 × 3 blocks) in
            // the reserve: no overrun.
            let mut ix = Index::new(1025 * 512, 512);
            ix.hold_back(600);
            for (k, n) in before {
                let e = ix.allocate(&[k], u64::from(n) * 512).unwrap();
                ix.insert(&[k], e);
            }
            let mut had = Had::new();
            for (k, e) in ix.map.iter() {
                had.entry(k[0]).or_default().insert(e.extents.blocks.clone());
            }
            ix.begin_save();
            let mut draft = ix.start_snapshot();
            copy_in_parts(&mut ix, &mut draft, steps, &mut had);
            proptest::prop_assert!(!draft.is_torn());
            proptest::prop_assert_eq!(ix.stats().hold_back_overruns, 0);
            let mut back = Index::restore(1025 * 512, 512, &draft.encode(), SnapshotFields::ALL);
            let back = back.as_mut().expect("the snapshot restores");
            for k in 0..16u8 {
                let now = ix.map.get(&[k][..]).map(|e| e.extents.blocks.clone());
                let saved = back.map.get(&[k][..]).map(|e| e.extents.blocks.clone());
                match (now, saved) {
                    (Some(now), saved) => proptest::prop_assert_eq!(Some(now), saved, "key {}", k),
                    (None, Some(saved)) => {
                        proptest::prop_assert!(had[&k].contains(&saved), "key {}: a value it never had", k);
                        for b in &saved {
                            proptest::prop_assert!(
                                ix.map.values().all(|e| !e.extents.blocks.contains(b)),
                                "key {}: block {} since taken by another value", k, b
                            );
                        }
                    }
                    (None, None) => {}
                }
            }
        }
    }

    /// The index a snapshot and the deltas after it load as.
    fn load_chain(chain: &[Vec<u8>], capacity: u64, block_size: u64) -> Option<Index> {
        let mut ix = Index::restore(capacity, block_size, &chain[0], SnapshotFields::ALL)?;
        for delta in &chain[1..] {
            ix.apply_delta(delta, SnapshotFields::ALL)?;
        }
        Some(ix)
    }

    proptest::proptest! {
        /// Saves copied a few keys at a time while keys are written, read and deleted
        /// between the parts, the first whole and the others deltas on the saves before:
        /// after each, the snapshot and its deltas load (no block named twice), and every
        /// key they hold has a value it had, in blocks no other value holds now. A last
        /// delta copied with nothing changing loads as the index is.
        #[test]
        fn deltas_copied_in_parts_are_true(
            saves in proptest::collection::vec(
                (
                    proptest::collection::vec(copy_op(), 0..16),
                    proptest::collection::vec(
                        (1..4usize, proptest::collection::vec(copy_op(), 0..4)),
                        1..10,
                    ),
                ),
                1..6,
            ),
        ) {
            // Room for every value written meanwhile in the reserve: no overrun.
            let (capacity, bs) = (2049 * 512, 512);
            let mut ix = Index::new(capacity, bs);
            ix.hold_back(1500);
            let mut had = Had::new();
            let mut chain: Vec<Vec<u8>> = Vec::new();
            let last = (Vec::new(), vec![(usize::MAX, Vec::new())]);
            for (before, steps) in saves.into_iter().chain([last]) {
                run_copy_ops(&mut ix, &mut had, before);
                let released = ix.begin_save();
                let changed = ix.take_changed();
                let mut draft = match changed.complete {
                    true if !chain.is_empty() => ix.start_delta(changed.keys),
                    _ => {
                        chain.clear();
                        ix.start_snapshot()
                    }
                };
                copy_in_parts(&mut ix, &mut draft, steps, &mut had);
                proptest::prop_assert!(!draft.is_torn());
                chain.push(draft.encode());
                ix.release(released);
                let back = load_chain(&chain, capacity, bs);
                let back = back.as_ref().expect("the snapshot and its deltas load");
                for (k, e) in back.map.iter() {
                    let blocks = &e.extents.blocks;
                    let known = had.get(&k[0]).is_some_and(|h| h.contains(blocks));
                    proptest::prop_assert!(known, "key {:?}: a value it never had", k);
                    for (other, now) in ix.map.iter() {
                        if other != k {
                            proptest::prop_assert!(
                                blocks.iter().all(|b| !now.extents.blocks.contains(b)),
                                "key {:?}: a block key {:?} holds", k, other
                            );
                        }
                    }
                }
            }
            proptest::prop_assert_eq!(ix.stats().hold_back_overruns, 0);
            let back = load_chain(&chain, capacity, bs).unwrap();
            proptest::prop_assert_eq!(back.map.len(), ix.map.len());
            for (k, e) in ix.map.iter() {
                let saved = back.map.get(k).map(|e| e.extents.blocks.clone());
                proptest::prop_assert_eq!(saved, Some(e.extents.blocks.clone()), "key {:?}", k);
            }
        }
    }

    /// A delta's keys load as the most recently used, in the order they were used last,
    /// behind the keys only the snapshot names: the load evicts as the index would.
    #[test]
    fn a_delta_loads_its_keys_as_the_most_recently_used() {
        let mut ix = Index::new(room(16, 512), 512);
        ix.hold_back(4);
        for k in ["a", "b", "c", "d"] {
            put(&mut ix, k, 512).unwrap();
        }
        let held = ix.begin_save();
        assert!(!ix.take_changed().complete);
        let base = ix.snapshot();
        ix.release(held);
        put(&mut ix, "d", 700).unwrap();
        put(&mut ix, "b", 100).unwrap();
        ix.remove(b"a");
        ix.begin_save();
        let changed = ix.take_changed();
        assert!(changed.complete);
        let mut draft = ix.start_delta(changed.keys);
        assert!(ix.snapshot_part(&mut draft, usize::MAX));
        let chain = [base, draft.encode()];
        let back = load_chain(&chain, room(16, 512), 512).unwrap();
        assert_eq!(back.snapshot(), ix.snapshot());
    }

    #[test]
    fn a_copy_in_parts_is_torn_by_an_overrun() {
        // 16 blocks for values, 9 of them for keys while holding back (see
        // keys_leave_the_reserve_free_and_a_store_short_of_it_overruns_the_hold_back).
        let mut ix = Index::new(17 * 4096, 4096);
        ix.hold_back(4);
        for i in 0..9 {
            put(&mut ix, &format!("k{i}"), 4096).unwrap();
        }
        ix.begin_save();
        let mut draft = ix.start_snapshot();
        assert!(!ix.snapshot_part(&mut draft, 1));
        // k0, copied, is evicted and its block held back; then a value wants it.
        for i in 9..17 {
            put(&mut ix, &format!("k{i}"), 4096).unwrap();
        }
        assert_eq!(ix.stats().hold_back_overruns, 1);
        while !ix.snapshot_part(&mut draft, 1) {}
        assert!(draft.is_torn());
        let torn = draft.encode();
        assert!(Index::restore(17 * 4096, 4096, &torn, SnapshotFields::ALL).is_none());
        // Copied under one lock, a snapshot is never torn.
        let mut whole = ix.start_snapshot();
        assert!(ix.snapshot_part(&mut whole, usize::MAX));
        assert!(!whole.is_torn());
    }

    /// Keys past their deadline but not removed yet (a purge removing none) are gone to
    /// lookups, and give their blocks to a new value before any live key is evicted.
    #[test]
    fn keys_past_their_deadline_go_before_live_ones_when_room_is_needed() {
        let mut ix = Index::new(room(6, 512), 512);
        for k in ["a", "b", "c", "d", "e", "f"] {
            put(&mut ix, k, 512).unwrap();
        }
        assert!(ix.set_deadline(b"b", Some(10)) && ix.set_deadline(b"e", Some(20)));
        assert_eq!(ix.purge_expired(100, 0), 0);
        assert!(!ix.contains(b"b") && ix.get(b"e").is_none() && ix.contains(b"a"));
        assert_eq!(ix.stats().keys, 4);
        put(&mut ix, "g", 1024).unwrap();
        let s = ix.stats();
        assert_eq!((s.keys, s.evictions, s.expired), (5, 0, 2));
        assert!(["a", "c", "d", "f", "g"]
            .iter()
            .all(|k| ix.contains(k.as_bytes())));
    }

    #[test]
    fn keys_past_their_deadline_are_purged() {
        let mut ix = Index::new(room(8, 512), 512);
        for k in ["a", "b", "c"] {
            put(&mut ix, k, 512).unwrap();
        }
        assert!(ix.set_deadline(b"a", Some(1_000)));
        assert!(ix.set_deadline(b"b", Some(2_000)));
        assert!(!ix.set_deadline(b"zz", Some(1)));
        assert_eq!(ix.deadline(b"a"), Some(Some(1_000)));
        assert_eq!(ix.deadline(b"c"), Some(None));
        assert_eq!(ix.deadline(b"zz"), None);
        // At its deadline a key still lives; past it, it goes.
        assert_eq!(ix.purge_expired(1_000, usize::MAX), 0);
        assert_eq!(ix.purge_expired(1_001, usize::MAX), 1);
        assert!(!ix.contains(b"a") && ix.contains(b"b"));
        // A deadline taken away, or a key replaced, is no longer waited for.
        ix.set_deadline(b"b", None);
        ix.set_deadline(b"c", Some(5_000));
        put(&mut ix, "c", 512).unwrap();
        assert_eq!(ix.purge_expired(u64::MAX, usize::MAX), 0);
        let s = ix.stats();
        assert_eq!((s.keys, s.used_blocks, s.expiring, s.expired), (2, 2, 0, 1));
    }

    #[test]
    fn snapshots_from_before_deadlines_and_checksums_restore_without_them() {
        let mut ix = Index::new(room(4, 512), 512);
        let mut e = ix.allocate(b"k", 700).unwrap();
        e.set_checksum(0xdead_beef);
        ix.insert(b"k", e);
        let snap = ix.snapshot();
        let back = Index::restore(room(4, 512), 512, &snap, SnapshotFields::ALL).unwrap();
        assert_eq!(back.snapshot(), snap);
        // Count, key length, value length and block count; then deadline and checksum.
        let fixed = 8 + 4 + 8 + 4;
        let before_checksums = [&snap[..fixed + 8], &snap[fixed + 16..]].concat();
        let before_deadlines = [&snap[..fixed], &snap[fixed + 16..]].concat();
        for (old, deadlines) in [(before_checksums, true), (before_deadlines, false)] {
            let fields = SnapshotFields {
                deadlines,
                checksums: false,
            };
            let mut back = Index::restore(room(4, 512), 512, &old, fields).unwrap();
            assert_eq!(back.deadline(b"k"), Some(None));
            let restored = back.get(b"k").unwrap();
            assert_eq!(
                restored.runs().collect::<Vec<_>>(),
                ix.get(b"k").unwrap().runs().collect::<Vec<_>>()
            );
            assert_eq!(restored.checksum(), None);
            assert!(Index::restore(room(4, 512), 512, &old, SnapshotFields::ALL).is_none());
        }
        // A checksum word is the CRC with bit 32 set, or 0.
        let mut bad = snap.clone();
        bad[fixed + 8 + 5] = 1;
        assert!(Index::restore(room(4, 512), 512, &bad, SnapshotFields::ALL).is_none());
    }

    #[test]
    fn deadlines_survive_a_snapshot_and_leave_with_their_keys() {
        let mut ix = Index::new(room(4, 512), 512);
        put(&mut ix, "a", 512).unwrap();
        put(&mut ix, "b", 512).unwrap();
        ix.set_deadline(b"a", Some(1_700_000_000_000));
        let snap = ix.snapshot();
        let back = Index::restore(room(4, 512), 512, &snap, SnapshotFields::ALL).unwrap();
        assert_eq!(back.deadline(b"a"), Some(Some(1_700_000_000_000)));
        assert_eq!(back.deadline(b"b"), Some(None));
        // Evicted for room, a key's deadline goes with it.
        put(&mut ix, "c", 3 * 512).unwrap();
        assert!(!ix.contains(b"a"));
        assert_eq!(ix.stats().expiring, 0);
    }
}
