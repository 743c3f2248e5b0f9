//! The index saved on the store's targets: read back at a start (and by `dpuflow kv
//! inspect`), checkpointed while the service runs, saved at a clean stop.

use super::{now_ms, KvService, POLL};
use crate::ir::{KvCache, StorageTarget};
use crate::kvcache::index::{Extents, Index, IndexStats, Run, SnapshotDraft, SNAPSHOT_PART};
use crate::kvcache::persist::{self, Layout, Saved};
use crate::kvcache::resp::reply;
use crate::kvcache::storage::{self, BlockTarget, Pool, TargetError};
use crc32c::crc32c;
use std::io;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// Values kept in memory written to the target in one run when the service stops.
const INLINE_WRITES: usize = 256;
/// With checkpoints, keys leave this share of the store's blocks free (a sixteenth) for
/// the values written between two checkpoints, as the blocks of values removed meanwhile
/// are held back.
const CHECKPOINT_RESERVE: u64 = 16;
/// How long a checkpoint leaves the index to requests between the parts it copies.
const SNAPSHOT_PAUSE: Duration = Duration::from_micros(50);
/// Deltas the superblock names after a snapshot at most (each takes 32 bytes of it, more
/// if its blocks are not in one run; a 512-byte block holds thirteen).
const MAX_DELTAS: usize = 8;

/// A target's saved index as read, nothing written: its first block, the superblock
/// decoded from it, and the index it names.
struct SavedRead {
    first: Vec<u8>,
    superblock: Result<persist::Superblock, persist::Unusable>,
    index: Result<Index, persist::Unusable>,
}

/// Reads the index saved on `t` for a store laid out as `layout`.
fn read_saved(t: &mut dyn BlockTarget, layout: &Layout) -> io::Result<SavedRead> {
    let bs = layout.block_size;
    let mut first = vec![0u8; bs as usize];
    t.read_at(0, &mut first)?;
    let sb = persist::Superblock::decode(&first);
    let blocks = layout.capacity / bs;
    let index = match &sb {
        // Runs outside the store, or more of them than it has blocks (a damaged
        // superblock whose checksum still held): refused before anything is read.
        Ok(sb)
            if sb
                .segments()
                .flat_map(|s| &s.runs)
                .any(|&(b, n)| b.checked_add(n).is_none_or(|e| e > blocks))
                || sb
                    .segments()
                    .flat_map(|s| &s.runs)
                    .map(|r| r.1)
                    .sum::<u64>()
                    > blocks =>
        {
            Err(persist::Unusable::Snapshot)
        }
        Ok(sb) => {
            // The snapshot and each delta, read from their runs.
            let mut read: Vec<Vec<u8>> = sb
                .segments()
                .map(|s| vec![0u8; (s.runs.iter().map(|r| r.1).sum::<u64>() * bs) as usize])
                .collect();
            let mut pieces = Vec::new();
            for (segment, bytes) in sb.segments().zip(&mut read) {
                pieces.extend(run_pieces(segment.runs.iter().copied(), bs, bytes));
            }
            t.read_many(&mut pieces)?;
            let deltas: Vec<&[u8]> = read[1..].iter().map(|d| &d[..]).collect();
            persist::load(sb, &read[0], &deltas, layout)
        }
        Err(why) => Err(why.clone()),
    };
    Ok(SavedRead {
        first,
        superblock: sb,
        index,
    })
}

/// `bytes` as the pieces that `runs` of blocks of `bs` bytes read into, in order: each the
/// run's offset on the target and its part of `bytes`.
pub(super) fn run_pieces(
    runs: impl Iterator<Item = Run>,
    bs: u64,
    bytes: &mut [u8],
) -> Vec<(u64, &mut [u8])> {
    let mut rest = bytes;
    runs.map(|(block, n)| {
        let (piece, after) = std::mem::take(&mut rest).split_at_mut((n * bs) as usize);
        rest = after;
        (block * bs, piece)
    })
    .collect()
}

/// The values a start dropped because the targets they lie on do not hold them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strangers {
    /// The targets, as [`storage::describe`] names them.
    pub targets: Vec<String>,
    /// How many values lay on them.
    pub values: usize,
}

impl std::fmt::Display for Strangers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} do not hold the values the saved index puts on them (values read back fail \
             their checksums: another store's drive or a blank one in their place); the {} \
             values with a block on them are dropped",
            self.targets.join(", "),
            self.values
        )
    }
}

/// Drops from `index`, just loaded from a store laid out as `layout` over `targets`
/// (reached through `t`), the values on targets that do not hold what it says they hold
/// ([`persist::strangers`]), and says which: when a striped store's target is replaced,
/// its values go at the start, where they would otherwise be found corrupt one read at a
/// time.
fn drop_strangers(
    index: &mut Index,
    t: &mut dyn BlockTarget,
    layout: &Layout,
    targets: &[StorageTarget],
) -> Option<Strangers> {
    let bs = layout.block_size;
    let strangers = persist::strangers(index, layout, |e| {
        let mut bytes = vec![0u8; (e.runs().map(|r| r.1).sum::<u64>() * bs) as usize];
        t.read_many(&mut run_pieces(e.runs(), bs, &mut bytes))
            .ok()?;
        Some(e.checksum() == Some(crc32c(&bytes[..e.len() as usize])))
    });
    if strangers.is_empty() {
        return None;
    }
    let mut flags = vec![false; targets.len()];
    for &s in &strangers {
        flags[s] = true;
    }
    Some(Strangers {
        values: index.remove_where(|_, e| persist::lies_on(layout, e, &flags)),
        targets: strangers
            .iter()
            .map(|&s| storage::describe(&targets[s]))
            .collect(),
    })
}

/// What a service's target holds for its next start (`dpuflow kv inspect`).
#[derive(Debug)]
pub struct Inspection {
    /// The saved index's superblock: how and in what layout it was saved, its snapshot
    /// and deltas.
    pub superblock: Result<persist::Superblock, persist::Unusable>,
    /// What the index it names holds, or why a start would not use it.
    pub index: Result<IndexStats, persist::Unusable>,
    /// The values a start would drop as they are not on their targets.
    pub strangers: Option<Strangers>,
}

/// Reads the index saved on `config`'s target, writing nothing: what its next start would
/// restore. A local file that does not exist is an error here, not created.
pub fn inspect(config: &KvCache) -> Result<Inspection, TargetError> {
    for target in &config.targets {
        if let StorageTarget::Local { path } = target {
            if !path.exists() {
                return Err(TargetError::Open {
                    target: storage::describe(target),
                    source: io::Error::new(
                        io::ErrorKind::NotFound,
                        "no such file (the service makes it at its first start)",
                    ),
                });
            }
        }
    }
    let mut t = storage::connect_store(config, &storage::Failures::of(&config.targets))?;
    let layout = Layout::of(config);
    let read = read_saved(t.as_mut(), &layout).map_err(|source| TargetError::Open {
        target: storage::describe_all(&config.targets),
        source,
    })?;
    let mut strangers = None;
    let index = read.index.map(|mut index| {
        strangers = drop_strangers(&mut index, t.as_mut(), &layout, &config.targets);
        index.stats()
    });
    Ok(Inspection {
        superblock: read.superblock,
        index,
        strangers,
    })
}

/// What a start restored, beside the index: with checkpoints, the blocks of the save it
/// was restored from, kept while the target's superblock names them, and that superblock
/// when the next checkpoint may be a delta on it (its layout is this build's).
type Restored = Option<(Extents, Option<persist::Superblock>)>;

/// The index saved on `pool`'s target, if there is one for this store; empty otherwise.
/// With checkpoints, what a saved index names is held back from then on, its snapshot's
/// blocks kept (returned beside it) and its superblock left as it is; without, the
/// superblock is marked taken before anything is written (see [`persist`]).
pub(super) fn saved_index(
    name: &str,
    config: &KvCache,
    pool: &Pool,
) -> io::Result<(Index, Restored)> {
    let (capacity, bs) = (config.capacity, config.block_size);
    let loaded = pool.with(|t| {
        let layout = Layout::of(config);
        let SavedRead {
            first,
            superblock: sb,
            index,
        } = read_saved(t, &layout)?;
        let loaded = index.map(|mut index| {
            if let Some(strangers) = drop_strangers(&mut index, t, &layout, &config.targets) {
                tracing::warn!(service = name, "kvcache targets {strangers}");
            }
            // With checkpoints, the snapshot's blocks are kept while its superblock names them.
            let kept = match (&sb, config.checkpoint) {
                (Ok(sb), Some(_)) => {
                    let runs: Vec<_> = sb.segments().flat_map(|s| s.runs.iter().copied()).collect();
                    let last = sb.is_current().then(|| sb.clone());
                    index.take_runs(&runs).map(|kept| (kept, last))
                }
                _ => None,
            };
            (index, kept, sb.as_ref().map(|sb| sb.saved).ok())
        });
        match (&sb, &loaded) {
            (Ok(_), Ok((_, Some(_), _))) | (Err(persist::Unusable::Missing), _) => {}
            (Ok(_), _) => t.write_at(0, &persist::Superblock::taken(&first))?,
            (Err(_), _) => t.write_at(0, &vec![0u8; bs as usize])?,
        }
        Ok(loaded)
    });
    let (mut index, kept) = match loaded? {
        Ok((index, kept, saved)) => {
            let from = match saved {
                Some(Saved::Checkpoint) => "checkpoint",
                _ => "clean stop",
            };
            tracing::info!(
                service = name,
                keys = index.stats().keys,
                saved_at = from,
                "kvcache index restored"
            );
            (index, kept)
        }
        Err(persist::Unusable::Missing) => (Index::new(capacity, bs), None),
        Err(why) => {
            // A saved index given up is a cache lost: said as a warning.
            tracing::warn!(service = name, %why, "kvcache starts empty");
            (Index::new(capacity, bs), None)
        }
    };
    if config.checkpoint.is_some() {
        index.hold_back(capacity / bs / CHECKPOINT_RESERVE);
    }
    Ok((index, kept))
}

/// The save the target's superblock names, while checkpoints are taken.
#[derive(Debug, Default)]
pub(super) struct Checkpoints {
    /// The blocks of its snapshot and deltas, kept.
    kept: Vec<Extents>,
    /// [`Index::changes`] when it was taken.
    changes: Option<u64>,
    /// What its superblock names, when this run wrote it and the next checkpoint may be a
    /// delta on it.
    names: Option<persist::Superblock>,
    /// The keys its snapshot held.
    snapshot_keys: u64,
    /// [`IndexStats::hold_back_overruns`] when it began.
    overruns: u64,
}

impl Checkpoints {
    /// Keeps `blocks` taken from now on: those of the save made at a clean stop.
    pub(super) fn keep(&mut self, blocks: Extents) {
        self.kept.push(blocks);
    }

    /// Where checkpoints stand after a start restored `index` and, with it, `restored`.
    pub(super) fn restored(restored: Restored, index: &mut Index) -> Checkpoints {
        let (kept, names) = restored.map_or((None, None), |(kept, last)| (Some(kept), last));
        if names.is_some() {
            // From here every change is noted: the first checkpoint may be a delta on the
            // save restored, rather than the whole index again.
            drop(index.take_changed());
        }
        Checkpoints {
            changes: kept.as_ref().map(|_| index.changes()),
            kept: kept.into_iter().collect(),
            snapshot_keys: index.stats().keys,
            names,
            ..Checkpoints::default()
        }
    }

    /// Whether a checkpoint of the `changed` keys is to be a delta: while the deltas
    /// together stay under half the snapshot they follow (and are few), a delta writes
    /// less; past that a load would apply more than the snapshot it reads, and a whole
    /// snapshot starts afresh. So it does after an overrun (`overruns` moved since the
    /// last began): values may then have taken blocks of keys the saves name still, which
    /// only a whole snapshot says afresh.
    fn delta_next(&self, changed: &[Arc<[u8]>], overruns: u64) -> bool {
        let Some(names) = &self.names else {
            return false;
        };
        if overruns != self.overruns {
            return false;
        }
        let per_key = names.snapshot.len / self.snapshot_keys.max(1);
        let deltas: u64 = names.deltas.iter().map(|d| d.len).sum();
        names.deltas.len() < MAX_DELTAS
            && deltas + per_key * changed.len() as u64 <= names.snapshot.len / 2
    }
}

impl KvService {
    /// Saves the index every `every` until the service stops, if it changed.
    pub(super) fn take_checkpoints(self: Arc<Self>, every: Duration) {
        let mut last = Instant::now();
        let mut failure_warning = crate::telemetry::WarnThrottle::default();
        while !self.stop.load(Relaxed) {
            std::thread::sleep(POLL);
            if last.elapsed() < every || self.stop.load(Relaxed) {
                continue;
            }
            last = Instant::now();
            match self.checkpoint() {
                Ok(_) => {}
                Err(e) => {
                    self.counters.checkpoint_failures.fetch_add(1, Relaxed);
                    if failure_warning.ready() {
                        tracing::warn!(service = %self.name, error = %e, "kvcache checkpoint failed: the target keeps the one before");
                    }
                }
            }
        }
    }

    /// Saves the index as a checkpoint, unless nothing changed since the last; whether it
    /// did: the keys changed since the last as a delta on it while deltas stay small, the
    /// whole index otherwise. The index is locked only to copy it, [`SNAPSHOT_PART`] keys
    /// at a time, and to take free blocks for the copy: the values kept in memory are
    /// written and the copy and the superblock after them, while requests go on.
    pub(super) fn checkpoint(&self) -> io::Result<bool> {
        let mut checkpoints = self
            .checkpoints
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut index = self.lock();
        let changes = index.changes();
        if checkpoints.changes == Some(changes) {
            return Ok(false);
        }
        // From here blocks freed are held back, so every record copied stays true.
        let mut released = index.begin_save();
        let overruns = index.stats().hold_back_overruns;
        // The keys changed, if not the delta's, are dropped once the index is unlocked.
        let changed = index.take_changed();
        let (mut draft, unused) = match changed.complete {
            true if checkpoints.delta_next(&changed.keys, overruns) => {
                (index.start_delta(changed.keys), None)
            }
            _ => (index.start_snapshot(), Some(changed)),
        };
        // A copy chasing keys used faster than it copies is finished under one lock.
        let most_parts = 2 * (index.stats().keys / SNAPSHOT_PART as u64) + 2;
        loop {
            let most = match draft.parts() < most_parts {
                true => SNAPSHOT_PART,
                false => usize::MAX,
            };
            if index.snapshot_part(&mut draft, most) {
                break;
            }
            drop(index);
            // Requests waiting for the lock take it before the next part does.
            std::thread::sleep(SNAPSHOT_PAUSE);
            index = self.lock();
        }
        let keys = index.stats().keys;
        drop(index);
        drop(unused);
        let delta = draft.is_delta();
        let written = self.save_snapshot(draft, checkpoints.names.as_ref(), &mut released);
        let mut index = self.lock();
        match written {
            Ok(save) => {
                index.release(released);
                if delta {
                    checkpoints.kept.push(save.blocks);
                } else {
                    // The snapshot and deltas before are no longer named; their blocks
                    // are held back in turn.
                    checkpoints.kept = vec![save.blocks];
                    checkpoints.snapshot_keys = keys;
                }
                checkpoints.names = Some(save.names);
                checkpoints.overruns = overruns;
                checkpoints.changes = Some(changes);
                self.counters.changes_at_last_save.store(changes, Relaxed);
                self.counters.last_save_failed.store(false, Relaxed);
                self.counters.checkpoints.fetch_add(1, Relaxed);
                let deltas = u64::from(delta);
                self.counters.checkpoint_deltas.fetch_add(deltas, Relaxed);
                self.counters
                    .checkpoint_bytes
                    .fetch_add(save.snapshot.len() as u64, Relaxed);
                let now = u64::try_from(now_ms()).unwrap_or(0);
                self.counters.last_save_ms.store(now, Relaxed);
                Ok(true)
            }
            Err(e) => {
                index.hold_again(released);
                // The next is whole, as the keys changed before this one began are not
                // noted any more (and a delta may have failed for want of room in the
                // superblock, and would again).
                checkpoints.names = None;
                self.counters.last_save_failed.store(true, Relaxed);
                Err(e)
            }
        }
    }

    /// Writes a checkpoint's snapshot or delta (on what `last` names): blocks for it (the
    /// index locked for that; short of free ones, from `released`, see
    /// [`Index::take_for_save`]), the values kept in memory it names, then the copy and
    /// the superblock.
    fn save_snapshot(
        &self,
        draft: SnapshotDraft,
        last: Option<&persist::Superblock>,
        released: &mut Vec<u64>,
    ) -> io::Result<persist::Save> {
        if draft.is_torn() {
            return Err(io::Error::other(
                "values took the blocks held back for it while the index was copied (an overrun)",
            ));
        }
        let inline = draft.inline_unwritten().to_vec();
        let delta = draft.is_delta();
        let snapshot = draft.encode();
        let blocks = self.lock().take_for_save(snapshot.len() as u64, released);
        let blocks = blocks
            .ok_or_else(|| io::Error::other("too few free blocks for the index's snapshot"))?;
        let save = match (delta, last) {
            (true, Some(last)) => persist::seal_delta(last, snapshot, blocks),
            _ => persist::seal(
                snapshot,
                blocks,
                &Layout::of(&self.config),
                Saved::Checkpoint,
            ),
        };
        let save =
            save.ok_or_else(|| io::Error::other("the snapshot's blocks are in too many runs"))?;
        self.write_inline(&inline)?;
        self.write_save(&save)?;
        Ok(save)
    }

    /// `SAVE`: a checkpoint now, answered once it is durable (or the index has not changed
    /// since the last), as Redis's `SAVE` answers once its RDB file is written.
    pub(super) fn save_command(&self, out: &mut Vec<u8>) {
        if self.config.checkpoint.is_none() {
            reply::error(
                out,
                "ERR checkpoints are off for this service (checkpoint off): the index is saved at a clean stop",
            );
            return;
        }
        match self.checkpoint() {
            Ok(_) => reply::ok(out),
            Err(e) => {
                self.counters.checkpoint_failures.fetch_add(1, Relaxed);
                tracing::warn!(service = %self.name, error = %e, "kvcache checkpoint (SAVE) failed: the target keeps the one before");
                reply::error(out, &format!("ERR checkpoint failed: {e}"));
            }
        }
    }

    /// Writes the values kept in memory among `values` that are not on their blocks yet.
    pub(super) fn write_inline(&self, values: &[Arc<Extents>]) -> io::Result<()> {
        let unwritten: Vec<_> = values.iter().filter(|e| e.inline_unwritten()).collect();
        for chunk in unwritten.chunks(INLINE_WRITES) {
            let pieces: Vec<_> = chunk
                .iter()
                .filter_map(|e| Some((&***e, e.inline()?)))
                .collect();
            self.write_values(&pieces)?;
            chunk.iter().for_each(|e| e.set_inline_written());
        }
        Ok(())
    }

    /// Writes a save: its snapshot, then its superblock once the values and the snapshot
    /// are durable (a superblock naming blocks a power loss took would serve wrong bytes),
    /// made durable itself.
    pub(super) fn write_save(&self, save: &persist::Save) -> io::Result<()> {
        let bs = self.config.block_size;
        self.pool
            .with(|t| {
                let mut pieces = Vec::new();
                let mut at = 0usize;
                for (first, n) in save.blocks.runs() {
                    let len = (n * bs) as usize;
                    pieces.push((first * bs, &save.snapshot[at..at + len]));
                    at += len;
                }
                t.write_many(&pieces)
            })
            .and_then(|()| self.pool.flush_all())
            .and_then(|()| self.pool.with(|t| t.write_at(0, &save.superblock)))
            .and_then(|()| self.pool.flush_all())
    }
}
