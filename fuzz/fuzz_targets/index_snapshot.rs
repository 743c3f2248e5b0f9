//! Any bytes as the KV-cache index's saved snapshot and a delta after it: an index whose
//! every key holds blocks of its own inside the store, or none; never a panic.
#![no_main]

use dpuflow::kvcache::index::{Index, SnapshotFields};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let (capacity, block_size) = (64 * 512, 512);
    // The first two bytes say where the snapshot ends and the delta begins.
    let Some((split, rest)) = bytes.split_first_chunk::<2>() else {
        return;
    };
    let (snapshot, delta) = rest.split_at(usize::from(u16::from_le_bytes(*split)).min(rest.len()));
    let Some(mut ix) = Index::restore(capacity, block_size, snapshot, SnapshotFields::ALL) else {
        return;
    };
    if !delta.is_empty() && ix.apply_delta(delta, SnapshotFields::ALL).is_none() {
        return;
    }
    let again = Index::restore(capacity, block_size, &ix.snapshot(), SnapshotFields::ALL)
        .expect("a restored index's snapshot restores");
    let keys = |ix: &Index| {
        (0..)
            .map_while(|map| ix.keys_of_map(map))
            .map(|keys| keys.len())
            .sum::<usize>()
    };
    assert_eq!(keys(&again), keys(&ix));
    assert_eq!(again.stats(), ix.stats());
});
