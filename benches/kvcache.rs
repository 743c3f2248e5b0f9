//! The KV-cache service's own work per request, without sockets or storage: parsing
//! requests (a pipelined burst of GETs; a SET carrying a 64 KiB value, whose bytes the
//! parser must not walk), and the index at a million keys (a GET's lookup; a SET's
//! allocation and insert in a full store, evicting the least recently used), and the
//! NVMe/TCP data digest of a MiB (`nvme_digest data`), what a checkpoint does with the
//! index locked at a million keys, and a 64 KiB value's `DUMP` payload made and read. Run with `cargo bench --bench kvcache`.

use criterion::{criterion_group, criterion_main, Criterion};
use dpuflow::kvcache::dump;
use dpuflow::kvcache::index::{Index, SNAPSHOT_PART};
use dpuflow::kvcache::resp::{self, reply};
use std::hint::black_box;
use std::time::{Duration, Instant};

/// A request as clients encode it.
fn request(words: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    reply::array(&mut out, words.len());
    for w in words {
        reply::bulk(&mut out, w);
    }
    out
}

fn parsing(c: &mut Criterion) {
    let burst: Vec<u8> = (0..16)
        .flat_map(|i| request(&[b"GET", format!("model@layer{i}:chunk").as_bytes()]))
        .collect();
    let (mut args, mut inline) = (Vec::new(), Vec::new());
    c.bench_function("resp: 16 pipelined GETs", |b| {
        b.iter(|| {
            let mut at = 0;
            while let Ok(Some(n)) =
                resp::parse(&burst[at..], &mut args, &mut inline, resp::MAX_BULK)
            {
                at += n;
            }
            black_box(at)
        })
    });
    let set = request(&[b"SET", b"model@layer0:chunk", &vec![7u8; 65536]]);
    c.bench_function("resp: SET of 64 KiB", |b| {
        b.iter(|| black_box(resp::parse(&set, &mut args, &mut inline, resp::MAX_BULK)))
    });
}

fn index(c: &mut Criterion) {
    const KEYS: u64 = 1 << 20;
    let block = 4096;
    // Room for every key but the last few: the store is full.
    let mut ix = Index::new((KEYS + 1) * block, block);
    let key = |i: u64| format!("model@{i:016x}:chunk").into_bytes();
    for i in 0..KEYS {
        let k = key(i);
        let e = ix.allocate(&k, block).expect("room");
        ix.insert(&k, e);
    }
    let mut i = 0u64;
    c.bench_function("index: GET of one of 1M keys", |b| {
        b.iter(|| {
            i = (i + 7919) % KEYS;
            black_box(ix.get(&key(i)).is_some())
        })
    });
    let mut next = KEYS;
    let mut set = |ix: &mut Index| {
        let k = key(next);
        next += 1;
        let e = ix.allocate(&k, block).expect("room");
        ix.insert(&k, e);
    };
    c.bench_function(
        "index: SET into a full store of 1M keys (one eviction)",
        |b| b.iter(|| set(&mut ix)),
    );
    // With checkpoints the keys changed are noted for the next delta; a checkpoint takes
    // them every 100,000 SETs here.
    let mut noted = 0;
    ix.take_changed();
    c.bench_function(
        "index: SET into a full store of 1M keys (one eviction), changes noted",
        |b| {
            b.iter(|| {
                set(&mut ix);
                noted += 1;
                if noted == 100_000 {
                    noted = 0;
                    black_box(ix.take_changed());
                }
            })
        },
    );
}

/// What a checkpoint does while it holds the index's lock, at a million keys in a store
/// of 64 KiB blocks with the checkpoint reserve free: a part of the copy (1024 keys'
/// records, in recency order), and at the end free blocks for the snapshot (the longest
/// runs of free blocks: here one run, and in a store whose free blocks are all apart);
/// then the whole copy, part after part, and what it does after, unlocked, before its
/// writes: the snapshot encoded; and a delta's copy and encoding, for 1 % of the keys
/// changed.
fn checkpoint(c: &mut Criterion) {
    const KEYS: u64 = 1 << 20;
    let block = 65536;
    let capacity = (KEYS + KEYS / 16 + 1) * block;
    let mut ix = Index::new(capacity, block);
    ix.hold_back(KEYS / 16);
    let key = |i: u64| format!("model@{i:016x}:chunk").into_bytes();
    for i in 0..KEYS {
        let k = key(i);
        let e = ix.allocate(&k, block).expect("room");
        ix.insert(&k, e);
    }
    let copy = |ix: &Index, part: usize| {
        let mut draft = ix.start_snapshot();
        while !ix.snapshot_part(&mut draft, part) {}
        draft
    };
    let mut group = c.benchmark_group("checkpoint");
    group.sample_size(10);
    group.bench_function(
        "index locked for a part of the copy (1024 of 1M keys)",
        |b| {
            let mut draft = ix.start_snapshot();
            b.iter(|| {
                if ix.snapshot_part(&mut draft, SNAPSHOT_PART) {
                    draft = ix.start_snapshot();
                }
            })
        },
    );
    // Free blocks for a snapshot of `len` bytes, timed; then freed again (blocks dropped
    // are held back while the index holds blocks back).
    let take_free = |ix: &mut Index, len: u64, iters: u64| {
        let mut took = Duration::ZERO;
        for _ in 0..iters {
            let since = Instant::now();
            let blocks = ix.take_free(len).expect("room");
            took += since.elapsed();
            drop(blocks);
            let held = ix.begin_save();
            ix.release(held);
        }
        took
    };
    group.bench_function("index locked for the snapshot's blocks (1M keys)", |b| {
        let len = copy(&ix, usize::MAX).encode().len() as u64;
        b.iter_custom(|iters| take_free(&mut ix, len, iters))
    });
    // A full store whose keys went one in sixteen: 65,536 free blocks, no two together.
    let mut apart = Index::new((KEYS + 1) * block, block);
    for i in 0..KEYS {
        let e = apart.allocate(&key(i), block).expect("room");
        apart.insert(&key(i), e);
    }
    for i in (0..KEYS).step_by(16) {
        apart.remove(&key(i));
    }
    group.bench_function(
        "index locked for the snapshot's blocks (1M keys, 65,536 free blocks apart)",
        |b| b.iter_custom(|iters| take_free(&mut apart, 60 << 20, iters)),
    );
    drop(apart);
    group.bench_function("the copy of 1M keys, part after part", |b| {
        b.iter_with_large_drop(|| copy(&ix, SNAPSHOT_PART))
    });
    group.bench_function("the snapshot of 1M keys encoded, unlocked", |b| {
        b.iter_batched(
            || copy(&ix, SNAPSHOT_PART),
            |draft| draft.encode(),
            criterion::BatchSize::LargeInput,
        )
    });
    // A delta instead: 1 % of the keys written again since the last checkpoint.
    ix.take_changed();
    for i in (0..KEYS).step_by(100) {
        let e = ix.allocate(&key(i), block).expect("room");
        ix.insert(&key(i), e);
    }
    let changed = ix.take_changed().keys;
    group.bench_function(
        "a delta of 10,486 of 1M keys copied part after part and encoded",
        |b| {
            b.iter_batched(
                || changed.clone(),
                |keys| {
                    let mut draft = ix.start_delta(keys);
                    while !ix.snapshot_part(&mut draft, SNAPSHOT_PART) {}
                    draft.encode()
                },
                criterion::BatchSize::LargeInput,
            )
        },
    );
    group.finish();
}

/// What `nvme_digest data` adds for each MiB moved: its CRC32C, once by each side.
fn digest(c: &mut Criterion) {
    let mib: Vec<u8> = (0..1 << 20)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    c.bench_function("NVMe/TCP data digest (CRC32C) of 1 MiB", |b| {
        b.iter(|| crc32c::crc32c(black_box(&mib)))
    });
}

/// A 64 KiB value's `DUMP` payload made, and read back as `RESTORE` reads it: a copy and
/// Redis's CRC-64 over the bytes.
fn payload(c: &mut Criterion) {
    let value: Vec<u8> = (0..65536u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let payload = dump::encode(&value);
    c.bench_function("DUMP payload of 64 KiB made", |b| {
        b.iter(|| dump::encode(black_box(&value)))
    });
    c.bench_function("DUMP payload of 64 KiB read", |b| {
        b.iter(|| dump::decode(black_box(&payload), u64::MAX).map(|v| v.len()))
    });
}

criterion_group!(benches, parsing, index, digest, checkpoint, payload);
criterion_main!(benches);
