//! The slow log, as Redis keeps one (`SLOWLOG GET`, `LEN`, `RESET`): the last requests that
//! took at least the service's `slowlog` threshold, with their arguments, when, how long,
//! and the connection's address and name. Here a request's time is from its read to its
//! reply ready, waits for the index and the target included: where the time goes in a
//! KV-cache is mostly the target's I/O, which an operator looking for slow requests
//! wants to see.
//!
//! Requests under the threshold cost a comparison; a slow one locks the log to add itself.

use super::clients::ClientInfo;
use super::commands::integer;
use crate::kvcache::resp::reply;
use std::collections::VecDeque;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Entries kept (Redis's default `slowlog-max-len`); the oldest go first.
pub const KEPT: usize = 128;
/// Arguments an entry keeps, the last standing for the rest (Redis's).
const MAX_ARGS: usize = 32;
/// Bytes an argument keeps (Redis's): a value of megabytes is not copied into the log.
const MAX_ARG_BYTES: usize = 128;
/// Entries `SLOWLOG GET` gives when not told how many.
const GIVEN: usize = 10;

#[derive(Debug)]
struct Entry {
    id: u64,
    /// Unix seconds when it was logged.
    at: i64,
    micros: u64,
    args: Vec<Vec<u8>>,
    addr: String,
    name: Vec<u8>,
}

#[derive(Debug, Default)]
struct Entries {
    next_id: u64,
    newest_last: VecDeque<Entry>,
}

/// A service's slow log.
#[derive(Debug)]
pub struct SlowLog {
    /// Requests that take at least this long are logged; `None`: none are.
    threshold: Option<Duration>,
    entries: Mutex<Entries>,
}

impl SlowLog {
    pub fn new(threshold: Option<Duration>) -> SlowLog {
        SlowLog {
            threshold,
            entries: Mutex::default(),
        }
    }

    /// `CONFIG GET slowlog-log-slower-than`: microseconds, -1 when off (Redis's negative).
    pub fn threshold_micros(&self) -> i64 {
        self.threshold
            .map_or(-1, |t| i64::try_from(t.as_micros()).unwrap_or(i64::MAX))
    }

    /// Logs the request of `args` from `client` when it `took` the threshold or longer;
    /// `others`, where it was served in a run with more requests like it (pipelined GETs,
    /// SETs or RESTOREs, whose time is the run's), names them in a last argument.
    pub fn note<'a>(
        &self,
        took: Duration,
        args: impl IntoIterator<Item = &'a [u8]>,
        others: Option<(usize, &str)>,
        client: &ClientInfo,
    ) {
        if self.threshold.is_none_or(|t| took < t) {
            return;
        }
        let mut kept: Vec<Vec<u8>> = Vec::new();
        let mut more = 0;
        for a in args {
            if kept.len() < MAX_ARGS {
                kept.push(shortened(a));
            } else {
                more += 1;
            }
        }
        // As Redis writes it: 31 arguments and a count of the rest.
        if more > 0 {
            more += 1;
            kept.pop();
            let last = format!("... ({more} more arguments)");
            kept.push(last.into_bytes());
        }
        if let Some((n, command)) = others.filter(|&(n, _)| n > 0) {
            kept.push(format!("... ({n} more {command} served with it)").into_bytes());
        }
        let mut e = self.lock();
        let id = e.next_id;
        e.next_id += 1;
        if e.newest_last.len() == KEPT {
            e.newest_last.pop_front();
        }
        e.newest_last.push_back(Entry {
            id,
            at: super::now_ms() / 1000,
            micros: u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            args: kept,
            addr: client.addr.to_string(),
            name: client.name(),
        });
    }

    /// `SLOWLOG GET [count]`, `LEN` and `RESET` (`sub` as the client wrote it), `LEN`'s
    /// and `RESET`'s arguments counted.
    pub fn command(&self, sub: &[u8], args: &[&[u8]], out: &mut Vec<u8>) {
        match sub.to_ascii_lowercase().as_slice() {
            b"len" => reply::integer(out, self.lock().newest_last.len() as i64),
            b"reset" => {
                self.lock().newest_last.clear();
                reply::ok(out);
            }
            _ if args.len() > 1 => {
                let sub = String::from_utf8_lossy(sub);
                let e = format!(
                    "ERR unknown subcommand or wrong number of arguments for '{sub}'. Try SLOWLOG HELP."
                );
                reply::error(out, &e);
            }
            _ => {
                let count = match args.first().map(|a| integer(a).filter(|&n| n >= -1)) {
                    None => GIVEN,
                    Some(Some(-1)) => usize::MAX,
                    Some(Some(n)) => n as usize,
                    Some(None) => {
                        let e = "ERR count should be greater than or equal to -1";
                        return reply::error(out, e);
                    }
                };
                let e = self.lock();
                let given: Vec<&Entry> = e.newest_last.iter().rev().take(count).collect();
                reply::array(out, given.len());
                for entry in given {
                    reply::array(out, 6);
                    reply::integer(out, entry.id as i64);
                    reply::integer(out, entry.at);
                    reply::integer(out, i64::try_from(entry.micros).unwrap_or(i64::MAX));
                    reply::array(out, entry.args.len());
                    for a in &entry.args {
                        reply::bulk(out, a);
                    }
                    reply::bulk(out, entry.addr.as_bytes());
                    reply::bulk(out, &entry.name);
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Entries> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An argument as an entry keeps it: its first [`MAX_ARG_BYTES`] bytes and a count of
/// the rest.
fn shortened(arg: &[u8]) -> Vec<u8> {
    if arg.len() <= MAX_ARG_BYTES {
        return arg.to_vec();
    }
    let mut kept = arg[..MAX_ARG_BYTES].to_vec();
    let more = arg.len() - MAX_ARG_BYTES;
    kept.extend_from_slice(format!("... ({more} more bytes)").as_bytes());
    kept
}

#[cfg(test)]
mod tests {
    use super::super::clients::a_host;
    use super::*;

    fn got(log: &SlowLog, args: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        log.command(b"get", args, &mut out);
        out
    }

    #[test]
    fn slow_requests_are_kept_newest_first_and_shortened() {
        let c = a_host();
        let log = SlowLog::new(Some(Duration::from_millis(10)));
        log.note(Duration::from_millis(9), [&b"GET"[..], b"fast"], None, &c);
        assert_eq!(got(&log, &[]), b"*0\r\n");
        let value = vec![b'v'; 200];
        log.note(
            Duration::from_millis(12),
            [&b"SET"[..], b"k", &value],
            None,
            &c,
        );
        log.note(
            Duration::from_millis(30),
            [&b"GET"[..], b"a"],
            Some((2, "GET")),
            &c,
        );
        let out = String::from_utf8(got(&log, &[b"1"])).unwrap();
        assert!(
            out.starts_with("*1\r\n*6\r\n:1\r\n:")
                && out.ends_with(
                    ":30000\r\n*3\r\n$3\r\nGET\r\n$1\r\na\r\n$31\r\n... (2 more GET served with it)\r\n$13\r\n10.0.0.7:4000\r\n$0\r\n\r\n"
                ),
            "{out:?}"
        );
        let all = String::from_utf8(got(&log, &[b"-1"])).unwrap();
        let shortened = format!("{}... (72 more bytes)", "v".repeat(128));
        assert!(
            all.starts_with("*2\r\n") && all.contains(&shortened),
            "{all:?}"
        );
        let many: Vec<Vec<u8>> = (0..40).map(|i| format!("k{i}").into_bytes()).collect();
        log.note(
            Duration::from_secs(1),
            many.iter().map(Vec::as_slice),
            None,
            &c,
        );
        let out = String::from_utf8(got(&log, &[b"1"])).unwrap();
        assert!(
            out.contains("*32\r\n$2\r\nk0\r\n") && out.contains("... (9 more arguments)"),
            "{out:?}"
        );
        assert_eq!(
            got(&log, &[b"-2"]),
            b"-ERR count should be greater than or equal to -1\r\n"
        );
        let mut out = Vec::new();
        log.command(b"reset", &[], &mut out);
        log.command(b"len", &[], &mut out);
        assert_eq!(out, b"+OK\r\n:0\r\n");
    }

    #[test]
    fn only_the_newest_are_kept() {
        let c = a_host();
        let log = SlowLog::new(Some(Duration::ZERO));
        for i in 0..KEPT + 5 {
            log.note(Duration::ZERO, [format!("k{i}").as_bytes()], None, &c);
        }
        let mut out = Vec::new();
        log.command(b"len", &[], &mut out);
        assert_eq!(out, format!(":{KEPT}\r\n").as_bytes());
        let newest = String::from_utf8(got(&log, &[b"1"])).unwrap();
        assert!(
            newest.starts_with(&format!("*1\r\n*6\r\n:{}\r\n", KEPT + 4)),
            "{newest:?}"
        );
        assert_eq!(SlowLog::new(None).threshold_micros(), -1);
    }
}
