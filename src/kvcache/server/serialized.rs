//! Values as Redis serializes them ([`dump`]): `DUMP` and `RESTORE`, the commands with
//! which Redis's own tools move keys between servers (`MIGRATE`, and `redis-cli
//! --cluster import` through it), so that a cache can move from a Redis to the service
//! and back (the service's own `MIGRATE` is in `migrate.rs`).

use super::clients::ClientInfo;
use super::commands::integer;
use super::values::{Only, Storing};
use super::{now_ms, KvService};
use crate::kvcache::dump;
use crate::kvcache::resp::{reply, Proto};
use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

impl KvService {
    /// `DUMP key`: the key's value as a payload `RESTORE` takes, here or in Redis; null
    /// for a key not held (or whose bytes no longer match their checksum).
    pub(super) fn dump(&self, key: &[u8], out: &mut Vec<u8>, proto: Proto) {
        let Some(extents) = self.lock().get(key) else {
            self.counters.misses.fetch_add(1, Relaxed);
            return reply::null(out, proto);
        };
        match self.read_all(&[&extents]) {
            Ok(mut read) => match read.pop().flatten() {
                Some(value) => {
                    self.counters.hits.fetch_add(1, Relaxed);
                    reply::bulk(out, &dump::encode(&value));
                }
                None => reply::null(out, proto),
            },
            Err(e) => {
                self.counters.storage_errors.fetch_add(1, Relaxed);
                tracing::warn!(service = %self.name, error = %e, "kvcache read failed");
                reply::error(out, &format!("ERR storage read failed: {e}"));
            }
        }
    }

    /// `RESTORE key ttl payload [REPLACE] [ABSTTL] [IDLETIME s] [FREQ n]` and
    /// `RESTORE-ASKING` (what `MIGRATE` sends a cluster node), each of `requests` (their
    /// words) answered as Redis 7 answers it (see [`KvService::restoring`]), in order; the
    /// values are stored together, as a run of `SET`s' are, but for a key restored again
    /// in the run, which waits for those before it.
    pub(super) fn restores<'a, R: AsRef<[&'a [u8]]>>(&self, requests: &[R], out: &mut Vec<u8>) {
        let mut replies: Vec<Result<(), String>> = Vec::with_capacity(requests.len());
        // The values to store, and which request each is; their keys.
        let mut pending: Vec<(usize, Restored)> = Vec::new();
        let mut keys: HashSet<&[u8]> = HashSet::new();
        for (i, words) in requests.iter().enumerate() {
            let words = words.as_ref();
            if words.get(1).is_some_and(|key| !keys.insert(key)) {
                self.store_restored(&mut pending, &mut replies);
                keys.clear();
                keys.insert(words[1]);
            }
            match self.restoring(words) {
                Ok(Some(restored)) => pending.push((i, restored)),
                Ok(None) => {}
                Err(e) => {
                    replies.push(Err(e));
                    continue;
                }
            }
            replies.push(Ok(()));
        }
        self.store_restored(&mut pending, &mut replies);
        for answer in replies {
            match answer {
                Ok(()) => reply::ok(out),
                Err(e) => reply::error(out, &e),
            }
        }
    }

    /// A run of pipelined `RESTORE`s (or of `RESTORE-ASKING`s: one name), each of
    /// `requests` (its words) served as [`KvService::restores`] serves them and counted
    /// as one of `client`'s.
    pub(super) fn restore_run(
        &self,
        requests: &[Vec<&[u8]>],
        out: &mut Vec<u8>,
        client: &ClientInfo,
    ) {
        let name = String::from_utf8_lossy(requests[0][0]).to_ascii_lowercase();
        client.served(&name);
        let since = Instant::now();
        self.restores(requests, out);
        let upper = name.to_ascii_uppercase();
        let others = Some((requests.len() - 1, upper.as_str()));
        let first = requests[0].iter().copied();
        self.finished(&name, requests.len(), since, first, others, client);
    }

    /// Stores the values `pending` holds, in one run, and notes each one's answer among
    /// `replies` (by its request's place): `BUSYKEY` for a key another client's value
    /// took meanwhile, where it may not be replaced.
    fn store_restored(
        &self,
        pending: &mut Vec<(usize, Restored)>,
        replies: &mut [Result<(), String>],
    ) {
        let items: Vec<Storing> = (pending.iter())
            .map(|(_, r)| Storing {
                key: r.key,
                value: &r.value,
                only: if r.replace { Only::Any } else { Only::Absent },
                deadline: r.deadline,
            })
            .collect();
        for ((i, _), stored) in pending.iter().zip(self.store_all(&items)) {
            replies[*i] = match stored {
                Ok(true) => Ok(()),
                Ok(false) => Err(BUSY_KEY.into()),
                Err(e) => Err(e),
            };
        }
        pending.clear();
    }

    /// A `RESTORE` request (its `words`) checked as Redis 7 checks one, in its order:
    /// the payload's value to store, with no deadline for a `ttl` of 0, else `ttl`
    /// milliseconds from now (`ABSTTL`: at that unix time in milliseconds); `None` for one
    /// whose time is already past, which stores nothing (and removes a key it replaces);
    /// else the error it is answered. Idle time and frequency are checked, not kept: the
    /// service evicts by recency, and a value restored is recent.
    fn restoring<'a>(&self, words: &[&'a [u8]]) -> Result<Option<Restored<'a>>, String> {
        let [_, key, ttl, payload, options @ ..] = words else {
            let name = words
                .first()
                .map(|n| String::from_utf8_lossy(n).to_lowercase());
            let name = name.unwrap_or_default();
            return Err(format!(
                "ERR wrong number of arguments for '{name}' command"
            ));
        };
        let (mut replace, mut absolute) = (false, false);
        let (mut idle, mut frequency) = (false, false);
        let mut options = options.iter();
        while let Some(word) = options.next() {
            let more = options.len() > 0;
            match word.to_ascii_lowercase().as_slice() {
                b"replace" => replace = true,
                b"absttl" => absolute = true,
                b"idletime" if more && !frequency => {
                    match options.next().and_then(|n| integer(n)) {
                        None => return Err(NOT_AN_INTEGER.into()),
                        Some(..0) => return Err("ERR Invalid IDLETIME value, must be >= 0".into()),
                        Some(_) => idle = true,
                    }
                }
                b"freq" if more && !idle => match options.next().and_then(|n| integer(n)) {
                    None => return Err(NOT_AN_INTEGER.into()),
                    Some(0..=255) => frequency = true,
                    Some(_) => return Err("ERR Invalid FREQ value, must be >= 0 and <= 255".into()),
                },
                _ => return Err("ERR syntax error".into()),
            }
        }
        if !replace && self.lock().contains(key) {
            return Err(BUSY_KEY.into());
        }
        let ttl = match integer(ttl) {
            None => return Err(NOT_AN_INTEGER.into()),
            Some(..0) => return Err("ERR Invalid TTL value, must be >= 0".into()),
            Some(t) => t,
        };
        let value = dump::decode(payload, self.config.capacity).map_err(|e| format!("ERR {e}"))?;
        let now = now_ms();
        let deadline = match (ttl, absolute) {
            (0, _) => None,
            (at, true) => Some(at),
            (after, false) => Some(now.saturating_add(after)),
        };
        if deadline.is_some_and(|at| at <= now) {
            // Restored and at once expired, as Redis has it: a key it replaces is gone.
            if replace {
                self.lock().remove(key);
            }
            return Ok(None);
        }
        Ok(Some(Restored {
            key,
            value,
            replace,
            deadline: deadline.and_then(|at| u64::try_from(at).ok()),
        }))
    }
}

/// A value a `RESTORE` stores.
struct Restored<'a> {
    key: &'a [u8],
    /// Borrowed from the payload where it is not compressed.
    value: Cow<'a, [u8]>,
    /// Whether it replaces a value held.
    replace: bool,
    /// Unix milliseconds.
    deadline: Option<u64>,
}

const NOT_AN_INTEGER: &str = "ERR value is not an integer or out of range";

const BUSY_KEY: &str = "BUSYKEY Target key name already exists.";
