//! Values between a connection and the target: blocks taken and written for `SET`s,
//! read back into replies for `GET`s, checked against their checksums.

use super::clients::ClientInfo;
use super::commands::refusal;
use super::saved::run_pieces;
use super::{send, KvService, Replies, CACHE_LINE, READ, WRITE};
use crate::kvcache::index::{Extents, StoreError};
use crate::kvcache::resp::{reply, Proto};
use crate::kvcache::storage::BlockTarget;
use crc32c::crc32c;
use std::io::{self, Write};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

/// When a `SET` stores: always, or only if the key is absent (`NX`) or present (`XX`).
#[derive(Debug, Clone, Copy, Default)]
pub(super) enum Only {
    #[default]
    Any,
    Absent,
    Present,
}

impl Only {
    pub(super) fn allows(self, held: bool) -> bool {
        match self {
            Only::Any => true,
            Only::Absent => !held,
            Only::Present => held,
        }
    }
}

/// What a `SET` does to the key's deadline: takes it away (the default), keeps it
/// (`KEEPTTL`), or sets one (unix milliseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Expiry {
    Clear,
    Keep,
    At(i64),
}

/// A value to store in a run of them ([`KvService::store_all`]), and on what terms.
#[derive(Debug, Clone, Copy)]
pub(super) struct Storing<'a> {
    pub(super) key: &'a [u8],
    pub(super) value: &'a [u8],
    /// Whether it is stored where the key is held, or is not, when it comes to be.
    pub(super) only: Only,
    /// Unix milliseconds it is removed at, if ever.
    pub(super) deadline: Option<u64>,
}

impl<'a> Storing<'a> {
    /// What `SET key value` stores.
    pub(super) fn set(key: &'a [u8], value: &'a [u8]) -> Storing<'a> {
        Storing {
            key,
            value,
            only: Only::Any,
            deadline: None,
        }
    }
}

/// The values read for a connection's replies before they are sent: an `MGET` of many
/// large values, or a deep pipeline of `GET`s, is answered a share at a time, so what it
/// holds is bounded by this (and one value), not by how many keys the client asked for.
const REPLY_SHARE: usize = 64 << 20;

/// The length of `value` when its bytes are to be read from the target (not kept in
/// memory).
fn read_len(value: Option<&Extents>) -> Option<usize> {
    value
        .filter(|e| e.inline().is_none())
        .map(|e| e.len() as usize)
}

impl KvService {
    /// Stores `value` under `key` if `only` allows: blocks from the index, the bytes to the
    /// target, then the key published (a reader never sees a value half written). `only`
    /// is checked before the I/O and again, under the same lock as the publishing, after
    /// it: of two `SET … NX` of one key at once, one stores. `false`: not stored.
    pub(super) fn store(
        &self,
        key: &[u8],
        value: &[u8],
        only: Only,
        expiry: Expiry,
    ) -> Result<bool, String> {
        let mut ix = self.lock();
        let before = ix.deadline(key);
        if !only.allows(before.is_some()) {
            return Ok(false);
        }
        let (mut extents, took_its_own) = ix
            .allocate_replacing(key, value.len() as u64)
            .map_err(|e| refusal(&e))?;
        drop(ix);
        self.fill(&mut extents, value);
        if extents.inline().is_none() {
            self.write_values(&[(&extents, value)])
                .map_err(|e| self.write_failed(&e))?;
        }
        let mut ix = self.lock();
        // The key's own value, given up to make room, still counts as there.
        if !only.allows(took_its_own || ix.contains(key)) {
            return Ok(false);
        }
        let deadline = match expiry {
            Expiry::Clear => None,
            // The deadline of the value replaced (given up for room, it was the one
            // before the write).
            Expiry::Keep => match ix.deadline(key) {
                Some(d) => d,
                None if took_its_own => before.flatten(),
                None => None,
            },
            Expiry::At(at) => u64::try_from(at).ok(),
        };
        ix.insert(key, extents);
        ix.set_deadline(key, deadline);
        Ok(true)
    }

    /// Stores each of `items` as `SET key value` would (on its terms: only where the key
    /// is or is not held when it comes to be stored, with its deadline), in order, their
    /// writes sent to the target together (an `MSET`, a run of pipelined `SET`s or
    /// `RESTORE`s): about one round trip for them all rather than one each; whether each
    /// was stored. Blocks are taken for the values first, up to
    /// [`KvService::batch_limit`] bytes at a time (blocks taken and not yet written
    /// cannot be evicted for other clients); should the store find no room for one while
    /// others wait to be written, those are written and made their keys' first and room
    /// is sought again, as one `SET` after another would find it.
    pub(super) fn store_all(&self, items: &[Storing]) -> Vec<Result<bool, String>> {
        let mut results = vec![Ok(true); items.len()];
        let mut waiting = Vec::new();
        let mut waiting_bytes = 0;
        for (i, item) in items.iter().enumerate() {
            let len = item.value.len() as u64;
            if waiting_bytes + len > self.batch_limit() {
                self.commit(items, &mut waiting, &mut results);
                waiting_bytes = 0;
            }
            let mut taken = self.lock().allocate(item.key, len);
            if matches!(taken, Err(StoreError::Busy)) && !waiting.is_empty() {
                self.commit(items, &mut waiting, &mut results);
                waiting_bytes = 0;
                taken = self.lock().allocate(item.key, len);
            }
            match taken {
                Ok(mut extents) => {
                    self.fill(&mut extents, item.value);
                    waiting.push((i, extents));
                    waiting_bytes += len;
                }
                Err(e) => results[i] = Err(refusal(&e)),
            }
        }
        self.commit(items, &mut waiting, &mut results);
        results
    }

    /// Notes the checksum of `value`, about to be `extents`' value, and keeps its bytes in
    /// memory if it is small enough (`inline_max`): such a value is not written to the
    /// target until the index is saved.
    pub(super) fn fill(&self, extents: &mut Extents, value: &[u8]) {
        extents.set_checksum(crc32c(value));
        if value.len() as u64 <= self.config.inline_max {
            extents.keep_inline(value);
        }
    }

    /// The most bytes of values one client's run of writes holds blocks for at a time: a
    /// sixteenth of the store, at most 16 MiB (past a few MiB the transfer, not the round
    /// trips, takes the time).
    pub(super) fn batch_limit(&self) -> u64 {
        (self.config.capacity / 16).min(16 << 20)
    }

    /// Writes the values of the `items` that `waiting` took blocks for (by index), in one
    /// run (those kept in memory are not written now), and makes each its key's, with
    /// its deadline, where its terms allow; if the write fails, each of them answers the
    /// error (their blocks go back to the free list, as do those of values not stored).
    fn commit(
        &self,
        items: &[Storing],
        waiting: &mut Vec<(usize, Extents)>,
        results: &mut [Result<bool, String>],
    ) {
        if waiting.is_empty() {
            return;
        }
        let values: Vec<_> = waiting
            .iter()
            .filter(|(_, e)| e.inline().is_none())
            .map(|(i, e)| (e, items[*i].value))
            .collect();
        let written = if values.is_empty() {
            Ok(())
        } else {
            self.write_values(&values)
        };
        match written {
            Ok(()) => {
                let mut ix = self.lock();
                for (i, extents) in waiting.drain(..) {
                    let item = &items[i];
                    if !item.only.allows(ix.contains(item.key)) {
                        results[i] = Ok(false);
                        continue;
                    }
                    ix.insert(item.key, extents);
                    if item.deadline.is_some() {
                        ix.set_deadline(item.key, item.deadline);
                    }
                }
            }
            Err(e) => {
                let e = self.write_failed(&e);
                for (i, _) in waiting.drain(..) {
                    results[i] = Err(e.clone());
                }
            }
        }
    }

    /// Writes values over their blocks, a piece per run, all sent together on one target
    /// connection; lengths rounded up to the target's alignment (a value's padding stays
    /// inside its last block).
    pub(super) fn write_values(&self, values: &[(&Extents, &[u8])]) -> io::Result<()> {
        let (bs, align) = (self.config.block_size, self.align as usize);
        // A value ending inside a unit of the alignment has that unit written from a copy,
        // padded: only a value's last run can end inside a block. The copies one after
        // another.
        let partial = values.iter().filter(|(_, v)| v.len() % align != 0);
        let mut tails = vec![0u8; partial.clone().count() * align];
        for ((_, v), tail) in partial.zip(tails.chunks_mut(align)) {
            let bytes = &v[v.len() - v.len() % align..];
            tail[..bytes.len()].copy_from_slice(bytes);
        }
        let mut tails = tails.chunks(align);
        let mut pieces = Vec::new();
        for (extents, value) in values {
            let mut at = 0usize;
            for (first, n) in extents.runs() {
                let len = ((n * bs) as usize).min(value.len() - at);
                let whole = len - len % align;
                pieces.push((first * bs, &value[at..at + whole]));
                if whole < len {
                    let tail = tails.next().expect("a tail for each partial value");
                    pieces.push((first * bs + whole as u64, tail));
                }
                at += len;
            }
        }
        pieces.retain(|(_, data)| !data.is_empty());
        self.with_target(WRITE, |t| t.write_many(&pieces))?;
        let bytes: usize = values.iter().map(|(_, v)| v.len()).sum();
        self.counters.written_bytes.fetch_add(bytes as u64, Relaxed);
        Ok(())
    }

    /// The reply to a failed write, counted and logged.
    fn write_failed(&self, e: &io::Error) -> String {
        self.counters.storage_errors.fetch_add(1, Relaxed);
        tracing::warn!(service = %self.name, error = %e, "kvcache write failed");
        format!("ERR storage write failed: {e}")
    }

    /// Runs a value's storage I/O `f` of `operation` (one of
    /// [`STORAGE_OPERATIONS`](super::STORAGE_OPERATIONS)) on a target connection, timing
    /// the wait for the connection and the I/O.
    fn with_target<T>(
        &self,
        operation: usize,
        mut f: impl FnMut(&mut dyn BlockTarget) -> io::Result<T>,
    ) -> io::Result<T> {
        let asked = Instant::now();
        let mut waited = false;
        self.pool.with(|t| {
            let began = Instant::now();
            // Once: a second run is the I/O again on a fresh connection.
            if !std::mem::replace(&mut waited, true) {
                self.counters.connection_waits.observe(began - asked);
            }
            let done = f(t);
            self.counters.storage[operation].observe(began.elapsed());
            done
        })
    }

    /// Where the first value of a reply starts: on a cache line, or on a sector of a target
    /// read directly, so that its bytes go from the device into the reply without a copy.
    pub(super) fn value_alignment(&self) -> usize {
        CACHE_LINE.max(self.align as usize)
    }

    /// Appends `key`'s value as a bulk string (or the null bulk string) to `out`, read from
    /// the target straight into `out`.
    pub(super) fn get(&self, key: &[u8], out: &mut Replies, proto: Proto) {
        let extents = self.lock().get(key);
        if let Some(len) = read_len(extents.as_deref()) {
            out.align_value(len, self.value_alignment());
        }
        self.reply_value(key, extents, out, proto);
    }

    /// The values of `keys`, their replies one after another in `out` (a pipeline's
    /// `GET`s, an `MGET`'s array), sent to `stream` whenever a [`REPLY_SHARE`] has been
    /// read, the last share left in `out`.
    pub(super) fn values_in_shares(
        &self,
        keys: &[&[u8]],
        out: &mut Replies,
        stream: &mut impl Write,
        proto: Proto,
    ) -> io::Result<()> {
        // A turn a share: none is held while a client takes its replies.
        let share = |keys, out: &mut Replies| {
            let _turn = self.turns.take(false);
            self.values_share(keys, out, proto)
        };
        let mut served = share(keys, out);
        while served < keys.len() {
            send(stream, out)?;
            served += share(&keys[served..], out);
        }
        Ok(())
    }

    /// The values of the first of `keys`, up to the one that makes their length reach
    /// [`REPLY_SHARE`], their replies one after another, read from the target in one run
    /// (see [`KvService::reply_values`]); how many keys that was (at least one).
    pub(super) fn values_share(&self, keys: &[&[u8]], out: &mut Replies, proto: Proto) -> usize {
        let values: Vec<_> = {
            let mut ix = self.lock();
            let mut bytes = 0;
            keys.iter()
                .map_while(|key| {
                    (bytes < REPLY_SHARE).then(|| {
                        let value = ix.get(key);
                        bytes += value.as_ref().map_or(0, |e| e.len() as usize);
                        value
                    })
                })
                .collect()
        };
        // Room for every reply of the share at once: growing it for a later value would
        // move the first off the place `align_value` chose for it.
        let room: usize = values
            .iter()
            .map(|v| {
                v.as_ref().map_or(reply::null_bytes(proto).len(), |e| {
                    reply::bulk_header_len(e.len() as usize) + e.len() as usize + 2
                })
            })
            .sum();
        out.reserve(room + self.value_alignment());
        if let Some(len) = read_len(values.first().and_then(Option::as_deref)) {
            out.align_value(len, self.value_alignment());
        }
        self.reply_values(&keys[..values.len()], &values, out, proto);
        values.len()
    }

    /// A run of `SET key value` requests, one of each of `items`, served as [`sets`]
    /// serves them and counted as that many `SET`s of `client`'s.
    ///
    /// [`sets`]: KvService::sets
    pub(super) fn set_run(&self, items: &[(&[u8], &[u8])], out: &mut Vec<u8>, client: &ClientInfo) {
        client.served("set");
        let since = Instant::now();
        self.sets(items, out);
        let (key, value) = items[0];
        let first = [&b"SET"[..], key, value];
        let others = Some((items.len() - 1, "SET"));
        self.finished("set", items.len(), since, first, others, client);
    }

    /// A run of `GET key` requests, one of each of `keys`, their values read share after
    /// share into `out` (not sent between), counted as that many `GET`s of `client`'s.
    pub(super) fn get_run(
        &self,
        keys: &[&[u8]],
        out: &mut Replies,
        proto: Proto,
        client: &ClientInfo,
    ) {
        client.served("get");
        let since = Instant::now();
        let mut served = 0;
        while served < keys.len() {
            served += self.values_share(&keys[served..], out, proto);
        }
        let first = [&b"GET"[..], keys[0]];
        let others = Some((keys.len() - 1, "GET"));
        self.finished("get", keys.len(), since, first, others, client);
    }

    /// `SET key value` of each of `items`, their replies one after another, the values
    /// written in one run (see [`KvService::store_all`]).
    pub(super) fn sets(&self, items: &[(&[u8], &[u8])], out: &mut Vec<u8>) {
        let items: Vec<Storing> = items.iter().map(|&(k, v)| Storing::set(k, v)).collect();
        for stored in self.store_all(&items) {
            match stored {
                Ok(_) => reply::ok(out),
                Err(e) => reply::error(out, &e),
            }
        }
    }

    /// The bytes of values held, as written: copied when kept in memory, the rest read from
    /// the target in one run of requests (one round trip, not one a value); `None` for a
    /// value whose bytes do not match its checksum (counted, as a read for a client counts
    /// it). Not a client's read: no hit or miss is counted.
    pub(super) fn read_all(&self, values: &[&Extents]) -> io::Result<Vec<Option<Vec<u8>>>> {
        let bs = self.config.block_size;
        // Whole blocks of each value on the target; nothing for one in memory.
        let mut bufs: Vec<Vec<u8>> = (values.iter())
            .map(|v| match v.inline() {
                Some(_) => Vec::new(),
                None => vec![0u8; (v.runs().map(|(_, n)| n).sum::<u64>() * bs) as usize],
            })
            .collect();
        if values.iter().any(|v| v.inline().is_none()) {
            self.with_target(READ, |t| {
                let mut pieces = Vec::new();
                let on_target = values.iter().zip(bufs.iter_mut());
                for (v, buf) in on_target.filter(|(v, _)| v.inline().is_none()) {
                    pieces.extend(run_pieces(v.runs(), bs, buf));
                }
                t.read_many(&mut pieces)
            })?;
        }
        let read = values.iter().zip(bufs).map(|(v, mut bytes)| {
            if let Some(kept) = v.inline() {
                return Some(kept.to_vec());
            }
            bytes.truncate(v.len() as usize);
            self.counters.read_bytes.fetch_add(v.len(), Relaxed);
            if v.checksum().is_some_and(|c| crc32c(&bytes) != c) {
                self.counters.corrupt_values.fetch_add(1, Relaxed);
                return None;
            }
            Some(bytes)
        });
        Ok(read.collect())
    }

    /// `key`'s value as a bulk string, read from the target straight into `out`; the null
    /// bulk string for none.
    pub(super) fn reply_value(
        &self,
        key: &[u8],
        extents: Option<Arc<Extents>>,
        out: &mut Vec<u8>,
        proto: Proto,
    ) {
        self.reply_values(&[key], &[extents], out, proto);
    }

    /// The values of `keys` as bulk strings one after another (the null bulk string for
    /// none): those kept in memory copied, the rest read from the target straight into
    /// `out` in one run of requests on one connection, so an `MGET` waits about one round
    /// trip rather than one a value. A value whose length is not whole units of the
    /// target's alignment has its last unit read aside and copied in. If the read fails,
    /// each value read answers the error. A value that does not match its checksum is
    /// answered as a miss (see [`KvService::drop_corrupt`]).
    fn reply_values(
        &self,
        keys: &[&[u8]],
        values: &[Option<Arc<Extents>>],
        out: &mut Vec<u8>,
        proto: Proto,
    ) {
        let before = out.len();
        // Each value to read from the target: its index in `values`, where it goes in
        // `out`, its blocks.
        let mut held = Vec::new();
        let (mut missed, mut in_memory) = (0, 0);
        for (i, v) in values.iter().enumerate() {
            match v {
                None => {
                    reply::null(out, proto);
                    missed += 1;
                }
                Some(extents) => {
                    let len = extents.len() as usize;
                    reply::bulk_header(out, len);
                    match extents.inline() {
                        Some(bytes) => {
                            out.extend_from_slice(bytes);
                            in_memory += 1;
                        }
                        None => {
                            held.push((i, out.len(), extents));
                            // Room for the value and its CRLF at once: a large reply's
                            // buffer is its size, not doubled by the last two bytes.
                            out.reserve(len + 2);
                            out.resize(out.len() + len, 0);
                        }
                    }
                    out.extend_from_slice(b"\r\n");
                }
            }
        }
        self.counters.hits.fetch_add(in_memory, Relaxed);
        if held.is_empty() {
            self.counters.misses.fetch_add(missed, Relaxed);
            return;
        }
        let (bs, align) = (self.config.block_size, self.align as usize);
        let partial = held
            .iter()
            .filter(|(_, _, e)| e.len() as usize % align != 0);
        // The last unit of each value that ends inside one, read aside, one after another.
        let mut tails = vec![0u8; partial.count() * align];
        // Where each tail's bytes go in `out`: (position, tail, bytes).
        let mut copies = Vec::new();
        let read = {
            let mut pieces = Vec::new();
            let mut tail_bufs = tails.chunks_mut(align).enumerate();
            let (mut rest, mut at) = (&mut out[..], 0usize);
            for &(_, start, extents) in &held {
                let (_, from) = std::mem::take(&mut rest).split_at_mut(start - at);
                let (mut value, after) = from.split_at_mut(extents.len() as usize);
                (rest, at) = (after, start + value.len());
                let mut pos = start;
                for (first, n) in extents.runs() {
                    let run = ((n * bs) as usize).min(value.len());
                    let (piece, after) = std::mem::take(&mut value).split_at_mut(run);
                    value = after;
                    let whole = run - run % align;
                    if whole > 0 {
                        pieces.push((first * bs, &mut piece[..whole]));
                    }
                    if whole < run {
                        let (i, tail) = tail_bufs.next().expect("a tail for each partial value");
                        pieces.push((first * bs + whole as u64, tail));
                        copies.push((pos + whole, i, run - whole));
                    }
                    pos += run;
                }
            }
            self.with_target(READ, |t| t.read_many(&mut pieces))
        };
        match read {
            Ok(()) => {
                for (at, i, n) in copies {
                    out[at..at + n].copy_from_slice(&tails[i * align..i * align + n]);
                }
                let bytes: u64 = held.iter().map(|(_, _, e)| e.len()).sum();
                self.counters.read_bytes.fetch_add(bytes, Relaxed);
                // The values that do not match their checksums, by index, ascending.
                let corrupt: Vec<usize> = held
                    .iter()
                    .filter(|(_, at, e)| {
                        e.checksum()
                            .is_some_and(|c| crc32c(&out[*at..*at + e.len() as usize]) != c)
                    })
                    .map(|&(i, _, _)| i)
                    .collect();
                let n = corrupt.len() as u64;
                self.counters.hits.fetch_add(held.len() as u64 - n, Relaxed);
                self.counters.misses.fetch_add(missed + n, Relaxed);
                if !corrupt.is_empty() {
                    self.drop_corrupt(keys, values, &corrupt, before, out, proto);
                }
            }
            Err(e) => {
                self.counters.hits.fetch_add(held.len() as u64, Relaxed);
                self.counters.misses.fetch_add(missed, Relaxed);
                out.truncate(before);
                self.counters.storage_errors.fetch_add(1, Relaxed);
                tracing::warn!(service = %self.name, error = %e, "kvcache read failed");
                for v in values {
                    match v.as_deref().map(|e| e.inline()) {
                        None => reply::null(out, proto),
                        Some(Some(bytes)) => reply::bulk(out, bytes),
                        Some(None) => reply::error(out, &format!("ERR storage read failed: {e}")),
                    }
                }
            }
        }
    }

    /// Answers the values [`KvService::reply_values`] read into `out` (their replies one
    /// after another from `before` on) that did not match their checksums (their indices
    /// in `corrupt`, ascending) as misses, and removes their keys unless they have new
    /// values since: the target returned other bytes than were written (a failing disk,
    /// an image changed under the service), and a cache's right answer to a value it
    /// cannot vouch for is none, which a client fills again, rather than wrong bytes or an
    /// error it may not expect. Counted and logged.
    #[cold]
    fn drop_corrupt(
        &self,
        keys: &[&[u8]],
        values: &[Option<Arc<Extents>>],
        corrupt: &[usize],
        before: usize,
        out: &mut Vec<u8>,
        proto: Proto,
    ) {
        let read = out.split_off(before);
        let mut replies = &read[..];
        for (i, value) in values.iter().enumerate() {
            // A null, or a bulk string's header, its bytes and CRLF.
            let len = value.as_ref().map_or(reply::null_bytes(proto).len(), |e| {
                let n = e.len() as usize;
                reply::bulk_header_len(n) + n + 2
            });
            let (reply, rest) = replies.split_at(len);
            replies = rest;
            let (Some(extents), Ok(_)) = (value, corrupt.binary_search(&i)) else {
                out.extend_from_slice(reply);
                continue;
            };
            let key = keys[i];
            reply::null(out, proto);
            self.counters.corrupt_values.fetch_add(1, Relaxed);
            self.lock().remove_value(key, extents);
            tracing::warn!(
                service = %self.name,
                key = %String::from_utf8_lossy(key),
                "kvcache value read back does not match its checksum: answered as a miss, key removed"
            );
        }
    }
}
