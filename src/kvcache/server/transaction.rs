//! Transactions, as Redis 7 has them: `MULTI`, then requests queued (`QUEUED`) rather
//! than served, then `EXEC` serving them one after another with no other client's request
//! between them, their replies in one array, or `DISCARD` dropping them. A request
//! refused as it is queued (a command not served, the wrong number of arguments, one
//! not allowed in a transaction, keys another node serves) fails the `EXEC` that follows
//! (`EXECABORT`); one that fails as it runs fails alone, the others running, as in Redis.
//! Clients send them for a pipeline of requests that must not be split: redis-py's
//! `pipeline()` does by default. Keys `WATCH`ed before the `MULTI` make the `EXEC` do
//! nothing (a null reply) if any of them changed meanwhile: optimistic locking, as
//! redis-py's `transaction()` runs a read-modify-write.
//!
//! Clients are served in parallel, each on its thread: requests take the service's turn
//! ([`Turns`]) shared, an `EXEC` alone, so a transaction's requests meet no other's. A
//! turn is held while a request is served, not while its reply is sent.

use super::catalog;
use super::cluster;
use super::commands::unknown_command;
use super::{KvService, Replies, Session};
use crate::kvcache::index::Extents;
use crate::kvcache::resp::{reply, Proto};
use std::sync::{PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak};

/// The requests a connection queued since its `MULTI`.
#[derive(Debug, Default)]
pub(super) struct Queued {
    requests: Vec<Vec<Vec<u8>>>,
    /// One was refused as it was queued: the `EXEC` is refused.
    refused: bool,
}

/// A key a connection `WATCH`es, and what it held then: its value and deadline, or
/// nothing. The value is known by its place in memory, which stays its own while watched
/// (a weak reference keeps the place, not the value's blocks): any `SET` of the key,
/// even of the same bytes, gives it a new value, and a key removed, expired, evicted or
/// given another deadline differs too. A key absent when watched and absent again at the
/// `EXEC` counts as unchanged even if it was set and removed between (Redis would fail
/// the `EXEC`).
#[derive(Debug)]
pub(super) struct Watched {
    key: Vec<u8>,
    held: Option<(Weak<Extents>, Option<u64>)>,
}

/// Who is served: any number of requests at once, or one `EXEC` alone.
#[derive(Debug, Default)]
pub(super) struct Turns(RwLock<()>);

/// A request's turn, held while it is served.
pub(super) enum Turn<'a> {
    Shared { _held: RwLockReadGuard<'a, ()> },
    Alone { _held: RwLockWriteGuard<'a, ()> },
}

impl Turns {
    /// The turn of a request: alone for the `EXEC` of a transaction, else shared.
    pub(super) fn take(&self, exec: bool) -> Turn<'_> {
        match exec {
            true => Turn::Alone {
                _held: self.0.write().unwrap_or_else(PoisonError::into_inner),
            },
            false => Turn::Shared {
                _held: self.0.read().unwrap_or_else(PoisonError::into_inner),
            },
        }
    }
}

/// Whether a connection in `s` sending `first` (a request's first word) ends a
/// transaction with `EXEC`, to be served alone.
pub(super) fn is_exec(s: &Session, first: Option<&[u8]>) -> bool {
    s.transaction.is_some() && first.is_some_and(|w| w.eq_ignore_ascii_case(b"exec"))
}

/// Whether the command `name` is served at once in a transaction rather than queued.
pub(super) fn served_at_once(name: &str) -> bool {
    matches!(name, "exec" | "discard" | "multi" | "quit" | "watch")
}

impl Queued {
    /// Marks the transaction refused: a request could not be queued.
    pub(super) fn refuse(&mut self) {
        self.refused = true;
    }
}

impl KvService {
    /// `MULTI`: begins a transaction; not within one.
    pub(super) fn multi(&self, out: &mut Vec<u8>, s: &mut Session) {
        if s.transaction.is_some() {
            return reply::error(out, "ERR MULTI calls can not be nested");
        }
        s.transaction = Some(Queued::default());
        reply::ok(out);
    }

    /// `MULTI`, `EXEC` or `DISCARD` (`name`) given arguments, as Redis refuses them: in a
    /// transaction that refuses it; an `EXEC`, in a transaction or not, as the end of one
    /// (what was queued and watched forgotten).
    pub(super) fn transaction_arity(&self, name: &str, out: &mut Vec<u8>, s: &mut Session) {
        let e = format!("wrong number of arguments for '{name}' command");
        match s.transaction.as_mut() {
            _ if name == "exec" => {
                s.transaction = None;
                s.watched.clear();
                reply::error(
                    out,
                    &format!("EXECABORT Transaction discarded because of: {e}"),
                );
            }
            Some(queued) => {
                queued.refuse();
                reply::error(out, &format!("ERR {e}"));
            }
            None => reply::error(out, &format!("ERR {e}")),
        }
    }

    /// `DISCARD`: drops the transaction and what it queued, and forgets the keys watched.
    pub(super) fn discard(&self, out: &mut Vec<u8>, s: &mut Session) {
        match s.transaction.take() {
            Some(_) => {
                s.watched.clear();
                reply::ok(out);
            }
            None => reply::error(out, "ERR DISCARD without MULTI"),
        }
    }

    /// `WATCH key [key …]`: notes what each key holds now, for the next `EXEC` to check
    /// (a key watched already keeps its first note); not within a transaction.
    pub(super) fn watch(&self, keys: &[&[u8]], out: &mut Vec<u8>, s: &mut Session) {
        if s.transaction.is_some() {
            return reply::error(out, "ERR WATCH inside MULTI is not allowed");
        }
        let ix = self.lock();
        for key in keys {
            if s.watched.iter().all(|w| w.key != *key) {
                let held = ix
                    .peek(key)
                    .map(|(v, d)| (std::sync::Arc::downgrade(&v), d));
                s.watched.push(Watched {
                    key: key.to_vec(),
                    held,
                });
            }
        }
        reply::ok(out);
    }

    /// Whether a key of `watched` holds other than it did when watched.
    fn changed(&self, watched: &[Watched]) -> bool {
        let ix = self.lock();
        watched.iter().any(|w| {
            let now = ix.peek(&w.key);
            match (&w.held, &now) {
                (None, None) => false,
                (Some((value, d0)), Some((current, d1))) => {
                    value.as_ptr() != std::sync::Arc::as_ptr(current) || d0 != d1
                }
                _ => true,
            }
        })
    }

    /// Queues `words`, a request of the command `name` in a transaction, or refuses it
    /// as Redis does when it cannot run: not served, the wrong number of arguments, not
    /// allowed in a transaction (the cluster's refusal of keys another node serves comes
    /// before, in [`KvService::execute`]).
    pub(super) fn queue(&self, name: &str, words: &[&[u8]], out: &mut Vec<u8>, s: &mut Session) {
        let Some(queued) = s.transaction.as_mut() else {
            return;
        };
        let refusal = match catalog::lookup(name, words.get(1).copied()) {
            None => Some(unknown_command(words[0], &words[1..])),
            Some((arity, _)) if !catalog::arity_holds(arity, words.len()) => Some(format!(
                "ERR wrong number of arguments for '{name}' command"
            )),
            Some((_, t)) if t.flags.split_whitespace().any(|f| f == "no_multi") => {
                Some("ERR Command not allowed inside a transaction".to_owned())
            }
            Some(_) => None,
        };
        match refusal {
            Some(e) => {
                queued.refused = true;
                reply::error(out, &e);
            }
            None => {
                queued
                    .requests
                    .push(words.iter().map(|w| w.to_vec()).collect());
                reply::simple(out, "QUEUED");
            }
        }
    }

    /// `EXEC`: serves the requests queued, in order, their replies in one array (the
    /// caller holds the service's turn alone); refused if one was refused as it was
    /// queued or, on a node of a cluster, when their keys are of more than one slot;
    /// nothing run if a key watched changed. The keys watched are forgotten.
    pub(super) fn exec(&self, out: &mut Replies, s: &mut Session) {
        let Some(queued) = s.transaction.take() else {
            return reply::error(out, "ERR EXEC without MULTI");
        };
        let watched = std::mem::take(&mut s.watched);
        if queued.refused {
            let e = "EXECABORT Transaction discarded because of previous errors.";
            return reply::error(out, e);
        }
        if self.changed(&watched) {
            // The null array: nothing was run.
            return out.extend_from_slice(match s.proto {
                Proto::Resp2 => b"*-1\r\n",
                Proto::Resp3 => b"_\r\n",
            });
        }
        let requests: Vec<Vec<&[u8]>> = (queued.requests.iter())
            .map(|r| r.iter().map(Vec::as_slice).collect())
            .collect();
        if self.cluster().is_some() && slots_of(&requests).nth(1).is_some() {
            return reply::error(out, "CROSSSLOT Keys in request don't hash to the same slot");
        }
        reply::array(out, requests.len());
        // Runs of plain SETs and GETs go to the target together, as pipelined ones do
        // (unless someone watches, who is shown each request as it runs).
        let together = !self.monitors.watching();
        let mut rest = &requests[..];
        while let Some(words) = rest.first() {
            let sets = run_of(rest, b"set", 3);
            if together && sets > 1 {
                let items: Vec<_> = rest[..sets].iter().map(|w| (w[1], w[2])).collect();
                self.set_run(&items, out, &s.client);
                rest = &rest[sets..];
                continue;
            }
            let gets = run_of(rest, b"get", 2);
            if together && gets > 1 {
                let keys: Vec<_> = rest[..gets].iter().map(|w| w[1]).collect();
                self.get_run(&keys, out, s.proto, &s.client);
                rest = &rest[gets..];
                continue;
            }
            // Its connection would stream what others do, and not read its requests.
            if words[0].eq_ignore_ascii_case(b"monitor") {
                reply::error(out, "ERR MONITOR isn't allowed for DENY BLOCKING client");
            } else {
                self.execute(words, out, s);
            }
            rest = &rest[1..];
        }
    }
}

/// How many of `requests`, from the first, are of the command `name` with `words` words.
fn run_of(requests: &[Vec<&[u8]>], name: &[u8], words: usize) -> usize {
    let of_it = |w: &&Vec<&[u8]>| w.len() == words && w[0].eq_ignore_ascii_case(name);
    requests.iter().take_while(of_it).count()
}

/// The slots of the keys of `requests`, each once (in order of first appearance).
fn slots_of<'a>(requests: &'a [Vec<&'a [u8]>]) -> impl Iterator<Item = usize> + 'a {
    let mut seen = Vec::new();
    requests
        .iter()
        .flat_map(|words| {
            let name = String::from_utf8_lossy(words[0]).to_ascii_lowercase();
            let keys = catalog::lookup(&name, words.get(1).copied())
                .and_then(|(_, t)| t.key_places(words));
            keys.into_iter()
                .flatten()
                .map(|at| cluster::slot(words[at]))
        })
        .filter(move |slot| {
            let new = !seen.contains(slot);
            if new {
                seen.push(*slot);
            }
            new
        })
}
