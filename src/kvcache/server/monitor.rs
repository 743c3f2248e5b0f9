//! `MONITOR`, as Redis streams it: each request any connection makes, as it is served,
//! to every connection that asked, one line a request:
//! `+1700000000.123456 [0 10.0.0.7:4000] "SET" "key" "value"`.
//!
//! With nobody watching a request costs one relaxed load. While someone watches, every
//! request takes the general path (runs of pipelined GETs and SETs are not gathered, so
//! each is shown as sent), its line is made once and offered to each watcher's queue;
//! a watcher that falls behind by [`QUEUED`] lines misses the lines that came meanwhile
//! (counted) rather than the service holding them for it.

use super::clients::ClientInfo;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

/// Lines a watcher may have waiting.
const QUEUED: usize = 65_536;
/// Bytes of an argument shown; the rest is counted (a value of megabytes is not copied
/// to every watcher). Redis shows arguments whole.
const SHOWN_BYTES: usize = 256;

/// The commands Redis leaves out of what it streams (its administrative ones), by name
/// or `command|subcommand`.
const UNSHOWN: [&str; 10] = [
    "client|kill",
    "client|list",
    "config|get",
    "config|resetstat",
    "config|rewrite",
    "config|set",
    "latency",
    "monitor",
    "save",
    "slowlog",
];

/// A connection watching: its queue of lines, and how many lines a full queue missed.
#[derive(Debug)]
struct Watcher {
    id: u64,
    queue: Sender<Vec<u8>>,
    missed: u64,
}

/// The connections watching.
#[derive(Debug, Default)]
pub struct Monitors {
    watching: AtomicUsize,
    watchers: Mutex<Vec<Watcher>>,
}

impl Monitors {
    /// Whether anyone watches: requests are then offered with [`Monitors::offer`].
    #[inline]
    pub fn watching(&self) -> bool {
        self.watching.load(Relaxed) > 0
    }

    /// Starts streaming to the connection `id`: its lines arrive on the receiver.
    pub fn watch(&self, id: u64) -> Receiver<Vec<u8>> {
        let (queue, lines) = crossbeam_channel::bounded(QUEUED);
        let mut watchers = self.lock();
        watchers.push(Watcher {
            id,
            queue,
            missed: 0,
        });
        self.watching.store(watchers.len(), Relaxed);
        lines
    }

    /// Stops streaming to the connection `id`; the lines it missed.
    fn stop_watching(&self, id: u64) -> u64 {
        let mut watchers = self.lock();
        let missed = watchers
            .iter()
            .filter(|w| w.id == id)
            .map(|w| w.missed)
            .sum();
        watchers.retain(|w| w.id != id);
        self.watching.store(watchers.len(), Relaxed);
        missed
    }

    /// Offers the request `words` of `client`, served at `unix_us`, to every watcher, as
    /// Redis would show it: not when it is one Redis leaves out; `AUTH`'s arguments and
    /// `HELLO`'s user and password redacted.
    pub fn offer(&self, words: &[&[u8]], client: &ClientInfo, unix_us: u64) {
        let Some((name, args)) = words.split_first() else {
            return;
        };
        let name = name.to_ascii_lowercase();
        let name = String::from_utf8_lossy(&name);
        let sub = args
            .first()
            .map(|s| s.to_ascii_lowercase())
            .unwrap_or_default();
        let full = format!("{name}|{}", String::from_utf8_lossy(&sub));
        if UNSHOWN.contains(&name.as_ref()) || UNSHOWN.contains(&full.as_str()) {
            return;
        }
        let line = line(words, client, unix_us);
        for w in self.lock().iter_mut() {
            if let Err(TrySendError::Full(_)) = w.queue.try_send(line.clone()) {
                w.missed += 1;
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Watcher>> {
        self.watchers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A connection's lines while it watches; it stops watching when this is dropped,
/// however its connection ends.
pub struct Watch<'a> {
    monitors: &'a Monitors,
    id: u64,
    pub lines: Receiver<Vec<u8>>,
}

impl<'a> Watch<'a> {
    /// The watch of the connection `id`, whose lines [`Monitors::watch`] gave.
    pub fn new(monitors: &'a Monitors, id: u64, lines: Receiver<Vec<u8>>) -> Watch<'a> {
        Watch {
            monitors,
            id,
            lines,
        }
    }
}

impl Drop for Watch<'_> {
    fn drop(&mut self) {
        let missed = self.monitors.stop_watching(self.id);
        if missed > 0 {
            tracing::info!(
                client = self.id,
                missed,
                "kvcache MONITOR fell behind and missed lines"
            );
        }
    }
}

/// The line of one request, with its CRLF.
fn line(words: &[&[u8]], client: &ClientInfo, unix_us: u64) -> Vec<u8> {
    let mut l = format!(
        "+{}.{:06} [0 {}]",
        unix_us / 1_000_000,
        unix_us % 1_000_000,
        client.addr
    )
    .into_bytes();
    let name = words.first().map(|w| w.to_ascii_lowercase());
    let secret = |i: usize| match name.as_deref() {
        Some(b"auth") => i > 0,
        // `HELLO version AUTH user password`: the two after AUTH.
        Some(b"hello") => (2..words.len())
            .any(|a| words[a - 1].eq_ignore_ascii_case(b"auth") && (i == a || i == a + 1)),
        _ => false,
    };
    for (i, w) in words.iter().enumerate() {
        l.push(b' ');
        if secret(i) {
            l.extend_from_slice(b"\"(redacted)\"");
        } else {
            quoted(&mut l, w);
        }
    }
    l.extend_from_slice(b"\r\n");
    l
}

/// `arg` in double quotes, escaped as Redis's `sdscatrepr` escapes it, its first
/// [`SHOWN_BYTES`] bytes and a count of the rest.
fn quoted(out: &mut Vec<u8>, arg: &[u8]) {
    out.push(b'"');
    for &b in &arg[..arg.len().min(SHOWN_BYTES)] {
        match b {
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'"' => out.extend_from_slice(b"\\\""),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x07 => out.extend_from_slice(b"\\a"),
            0x08 => out.extend_from_slice(b"\\b"),
            b' '..=b'~' => out.push(b),
            _ => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
        }
    }
    if arg.len() > SHOWN_BYTES {
        let more = arg.len() - SHOWN_BYTES;
        out.extend_from_slice(format!("... ({more} more bytes)").as_bytes());
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::super::clients::a_host;
    use super::*;

    #[test]
    fn lines_read_as_redis_writes_them() {
        let c = a_host();
        let line =
            |words: &[&[u8]]| String::from_utf8(line(words, &c, 1_796_539_162_000_123)).unwrap();
        assert_eq!(
            line(&[b"SET", b"q", b"a b\n\x01"]),
            "+1796539162.000123 [0 10.0.0.7:4000] \"SET\" \"q\" \"a b\\n\\x01\"\r\n"
        );
        assert_eq!(
            line(&[b"set", b"k", b"x\ty\"\\z\x01\xff"]),
            "+1796539162.000123 [0 10.0.0.7:4000] \"set\" \"k\" \"x\\ty\\\"\\\\z\\x01\\xff\"\r\n"
        );
        assert!(line(&[b"auth", b"default", b"pw"])
            .ends_with("\"auth\" \"(redacted)\" \"(redacted)\"\r\n"));
        assert!(
            line(&[b"hello", b"3", b"AUTH", b"u", b"pw", b"SETNAME", b"n"]).ends_with(
                "\"hello\" \"3\" \"AUTH\" \"(redacted)\" \"(redacted)\" \"SETNAME\" \"n\"\r\n"
            )
        );
        let long = line(&[b"SET", b"k", &[b'v'; 300]]);
        assert!(
            long.ends_with(&format!("{}... (44 more bytes)\"\r\n", "v".repeat(256))),
            "{long}"
        );
    }

    #[test]
    fn watchers_get_what_is_shown_and_a_full_queue_misses_lines() {
        let c = a_host();
        let m = Monitors::default();
        assert!(!m.watching());
        m.offer(&[b"GET", b"k"], &c, 0);
        let rx = m.watch(7);
        assert!(m.watching());
        for words in [
            &[&b"CONFIG"[..], b"GET", b"x"][..],
            &[b"client", b"LIST"],
            &[b"SLOWLOG", b"LEN"],
        ] {
            m.offer(words, &c, 0);
        }
        m.offer(&[b"client", b"setname", b"w"], &c, 0);
        let got: Vec<Vec<u8>> = rx.try_iter().collect();
        assert_eq!(got.len(), 1);
        assert!(got[0].ends_with(b"\"client\" \"setname\" \"w\"\r\n"));
        for _ in 0..QUEUED + 3 {
            m.offer(&[b"PING"], &c, 0);
        }
        assert_eq!(m.stop_watching(7), 3);
        assert!(!m.watching());
        drop(Watch::new(&m, 8, m.watch(8)));
        assert!(!m.watching());
    }
}
