//! Any bytes a client sends the KV-cache service: the request parser frames them or
//! refuses them, never panics, and what it frames lies within the bytes.
#![no_main]

use dpuflow::kvcache::resp;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let (mut args, mut inline) = (Vec::new(), Vec::new());
    let mut at = 0;
    while at < bytes.len() {
        let buf = &bytes[at..];
        match resp::parse(buf, &mut args, &mut inline, 1 << 20) {
            Ok(Some(n)) => {
                assert!(n > 0 && n <= buf.len());
                // An inline command's words are unescaped, never longer than its line.
                let within = if resp::is_inline(buf) {
                    inline.len()
                } else {
                    n
                };
                assert!(within <= n);
                assert!(args.iter().all(|r| r.start <= r.end && r.end <= within));
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
