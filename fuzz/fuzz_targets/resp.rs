//! Any bytes a client sends the KV-cache service: the request parser frames them or
//! refuses them, never panics, and what it frames lies within the bytes.
#![no_main]

use dpuflow::kvcache::resp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let mut args = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let buf = &bytes[at..];
        match resp::parse(buf, &mut args, 1 << 20) {
            Ok(Some(n)) => {
                assert!(n > 0 && n <= buf.len());
                assert!(args.iter().all(|r| r.start <= r.end && r.end <= n));
                at += n;
            }
            Ok(None) => {
                assert!(args.iter().all(|r| r.end <= buf.len()));
                if let Some(a) = resp::awaited(buf, &args) {
                    assert!(a.len > buf.len() || a.len >= args.last().map_or(0, |r| r.end));
                    assert!(a.data <= buf.len() && a.data + 2 <= a.len);
                }
                break;
            }
            Err(_) => break,
        }
    }
});
