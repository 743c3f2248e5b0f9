//! Any file given as an input capture: its frames are read or an error says why, never a
//! panic, and a rewind reads the same frames again.
#![no_main]

use dpuflow::io::pcap::CaptureReader;
use libfuzzer_sys::fuzz_target;

fn frames(r: &mut CaptureReader) -> Vec<(u64, usize)> {
    let mut seen = Vec::new();
    while let Some(Ok(f)) = r.next_with(|ns, frame| (ns, frame.len())) {
        seen.push(f);
    }
    seen
}

fuzz_target!(|bytes: &[u8]| {
    let path = std::env::temp_dir().join(format!("dpuflow-fuzz-{}.pcap", std::process::id()));
    std::fs::write(&path, bytes).expect("write the capture");
    if let Ok(mut r) = CaptureReader::open(&path) {
        let first = frames(&mut r);
        if r.rewind().is_ok() {
            assert_eq!(frames(&mut r), first);
        }
    }
});
