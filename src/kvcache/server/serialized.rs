//! Values as Redis serializes them ([`dump`]): `DUMP` and `RESTORE`, the commands with
//! which Redis's own tools move keys between servers (`MIGRATE`, and `redis-cli
//! --cluster import` through it), so that a cache can move from a Redis to the service
//! and back (the service's own `MIGRATE` is in `migrate.rs`).

use super::commands::integer;
use super::values::{Expiry, Only};
use super::{now_ms, KvService};
use crate::kvcache::dump;
use crate::kvcache::resp::{reply, Proto};
use std::sync::atomic::Ordering::Relaxed;

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

    /// `RESTORE key ttl payload [REPLACE] [ABSTTL] [IDLETIME s] [FREQ n]`, and
    /// `RESTORE-ASKING` (what `MIGRATE` sends a cluster node), as Redis 7 checks them, in
    /// its order: the payload's value stored as `SET` stores it, with no deadline for a
    /// `ttl` of 0, else `ttl` milliseconds from now (`ABSTTL`: at that unix time in
    /// milliseconds; one already past stores nothing). Idle time and frequency are
    /// checked, not kept: the service evicts by recency, and a value restored is recent.
    pub(super) fn restore(&self, name: &str, args: &[&[u8]], out: &mut Vec<u8>) {
        let [key, ttl, payload, options @ ..] = args else {
            let e = format!("ERR wrong number of arguments for '{name}' command");
            return reply::error(out, &e);
        };
        let (mut replace, mut absolute) = (false, false);
        let (mut idle, mut frequency) = (false, false);
        let mut words = options.iter();
        while let Some(word) = words.next() {
            let more = words.len() > 0;
            match word.to_ascii_lowercase().as_slice() {
                b"replace" => replace = true,
                b"absttl" => absolute = true,
                b"idletime" if more && !frequency => match words.next().and_then(|n| integer(n)) {
                    None => return reply::error(out, NOT_AN_INTEGER),
                    Some(..0) => {
                        return reply::error(out, "ERR Invalid IDLETIME value, must be >= 0")
                    }
                    Some(_) => idle = true,
                },
                b"freq" if more && !idle => match words.next().and_then(|n| integer(n)) {
                    None => return reply::error(out, NOT_AN_INTEGER),
                    Some(0..=255) => frequency = true,
                    Some(_) => {
                        let e = "ERR Invalid FREQ value, must be >= 0 and <= 255";
                        return reply::error(out, e);
                    }
                },
                _ => return reply::error(out, "ERR syntax error"),
            }
        }
        if !replace && self.lock().contains(key) {
            return reply::error(out, BUSY_KEY);
        }
        let ttl = match integer(ttl) {
            None => return reply::error(out, NOT_AN_INTEGER),
            Some(..0) => return reply::error(out, "ERR Invalid TTL value, must be >= 0"),
            Some(t) => t,
        };
        let value = match dump::decode(payload, self.config.capacity) {
            Ok(value) => value,
            Err(e) => return reply::error(out, &format!("ERR {e}")),
        };
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
            return reply::ok(out);
        }
        let only = if replace { Only::Any } else { Only::Absent };
        let expiry = deadline.map_or(Expiry::Clear, Expiry::At);
        match self.store(key, &value, only, expiry) {
            Ok(true) => reply::ok(out),
            // Another client's value came first.
            Ok(false) => reply::error(out, BUSY_KEY),
            Err(e) => reply::error(out, &e),
        }
    }
}

const NOT_AN_INTEGER: &str = "ERR value is not an integer or out of range";

const BUSY_KEY: &str = "BUSYKEY Target key name already exists.";
