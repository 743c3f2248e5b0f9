//! Any bytes as the KV-cache index's saved snapshot: an index whose every key holds blocks
//! of its own inside the store, or none; never a panic.
#![no_main]

use dpuflow::kvcache::index::{Index, SnapshotFields};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let (capacity, block_size) = (64 * 512, 512);
    if let Some(ix) = Index::restore(capacity, block_size, bytes, SnapshotFields::ALL) {
        let again = Index::restore(capacity, block_size, &ix.snapshot(), SnapshotFields::ALL)
            .expect("a restored index's snapshot restores");
        assert_eq!(again.keys().count(), ix.keys().count());
    }
});
