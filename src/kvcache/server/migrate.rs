//! `MIGRATE`: keys sent to another Redis-protocol server (a Redis, or another service) as
//! Redis 7 sends them, each as a `RESTORE` of its value serialized ([`dump`]) with the
//! time it has left, and removed here once taken unless `COPY` is given. What Redis's
//! tools drive to move keys: `redis-cli --cluster import` from a service into a cluster.
//! The connection is kept for the next `MIGRATE` to the same place for ten seconds, as
//! Redis keeps it; a service that speaks TLS makes it over TLS, as a Redis with
//! `tls-cluster yes` does.

use super::commands::integer;
use super::peer::{request, Answer, Peer};
use super::{now_ms, KvService};
use crate::kvcache::dump;
use crate::kvcache::index::Extents;
use crate::kvcache::resp::reply;
use rustls::pki_types::ServerName;
use std::io::{self, Write};
use std::net::ToSocketAddrs;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// About how many bytes of values are read and sent before their replies are read.
const SHARE: u64 = 8 << 20;

/// The places of a `MIGRATE` request's keys, as Redis 7 finds them: those after `KEYS`
/// (when the key argument is empty), else the key argument; the arguments of `AUTH` and
/// `AUTH2` are passed over, not taken for the keyword.
pub(super) fn key_places(words: &[&[u8]]) -> Vec<usize> {
    let mut at = 6;
    while at < words.len() {
        let word = words[at].to_ascii_lowercase();
        match word.as_slice() {
            b"keys" if words[3].is_empty() => return (at + 1..words.len()).collect(),
            b"keys" => return Vec::new(),
            b"auth" => at += 1,
            b"auth2" => at += 2,
            _ => {}
        }
        at += 1;
    }
    (words.len() > 3).then_some(3).into_iter().collect()
}

/// How long a connection `MIGRATE` made is kept unused for the next to the same place,
/// and how many are kept: as Redis keeps them.
const KEPT_FOR: Duration = Duration::from_secs(10);
const MOST_KEPT: usize = 64;

/// The connections `MIGRATE` made, kept for the next to the same host and port (a
/// `redis-cli --cluster import` from the service sends one key a `MIGRATE`), with the
/// database each has selected.
#[derive(Default)]
pub(super) struct Connections {
    kept: Mutex<Vec<Kept>>,
}

/// A connection kept: where it goes, what it has selected, when it was last used.
struct Kept {
    host: Vec<u8>,
    port: Vec<u8>,
    peer: Peer,
    db: i64,
    used: Instant,
}

impl std::fmt::Debug for Connections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Connections({})", self.lock().len())
    }
}

impl Connections {
    fn lock(&self) -> MutexGuard<'_, Vec<Kept>> {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The connection kept to `host` `port`, taken for a `MIGRATE`, and its database.
    fn take(&self, host: &[u8], port: &[u8]) -> Option<(Peer, i64)> {
        let mut kept = self.lock();
        let i = kept.iter().position(|k| k.host == host && k.port == port)?;
        let k = kept.swap_remove(i);
        Some((k.peer, k.db))
    }

    /// Keeps `peer`, to `host` `port` with `db` selected, for the next `MIGRATE` there;
    /// the one unused longest goes when as many as are kept are.
    fn keep(&self, host: &[u8], port: &[u8], peer: Peer, db: i64) {
        let mut kept = self.lock();
        if kept.len() >= MOST_KEPT {
            if let Some(i) = (0..kept.len()).min_by_key(|&i| kept[i].used) {
                kept.swap_remove(i);
            }
        }
        kept.push(Kept {
            host: host.to_vec(),
            port: port.to_vec(),
            peer,
            db,
            used: Instant::now(),
        });
    }

    /// Closes the connections unused for [`KEPT_FOR`].
    pub(super) fn close_idle(&self) {
        let mut kept = self.lock();
        if !kept.is_empty() {
            kept.retain(|k| k.used.elapsed() < KEPT_FOR);
        }
    }
}

/// What a `MIGRATE` asks: where, which keys, and how.
struct Migration<'a> {
    host: &'a [u8],
    port: &'a [u8],
    db: i64,
    timeout: Duration,
    copy: bool,
    replace: bool,
    /// `AUTH` (a password) or `AUTH2` (a user and a password) to send first.
    auth: Vec<&'a [u8]>,
    keys: Vec<&'a [u8]>,
}

impl<'a> Migration<'a> {
    /// `MIGRATE host port key|"" db timeout [COPY] [REPLACE] [AUTH password | AUTH2 user
    /// password] [KEYS key …]` read as Redis 7 reads it, or the error it answers.
    fn of(args: &[&'a [u8]]) -> Result<Migration<'a>, &'static str> {
        let [host, port, key, db, timeout, options @ ..] = args else {
            return Err("ERR wrong number of arguments for 'migrate' command");
        };
        let mut m = Migration {
            host,
            port,
            db: 0,
            timeout: Duration::ZERO,
            copy: false,
            replace: false,
            auth: Vec::new(),
            keys: vec![key],
        };
        let mut words = options.iter();
        while let Some(word) = words.next() {
            match word.to_ascii_lowercase().as_slice() {
                b"copy" => m.copy = true,
                b"replace" => m.replace = true,
                b"auth" => {
                    let password = words.next().ok_or("ERR syntax error")?;
                    m.auth = vec![password];
                }
                b"auth2" if words.len() >= 2 => {
                    m.auth = words.by_ref().take(2).copied().collect();
                }
                b"keys" if !key.is_empty() => {
                    return Err("ERR When using MIGRATE KEYS option, the key argument must be set to the empty string");
                }
                b"keys" => {
                    m.keys = words.copied().collect();
                    break;
                }
                _ => return Err("ERR syntax error"),
            }
        }
        let not_an_integer = "ERR value is not an integer or out of range";
        let timeout = integer(timeout).ok_or(not_an_integer)?;
        m.db = integer(db).ok_or(not_an_integer)?;
        // As Redis: no timeout is a second's.
        let ms = if timeout <= 0 { 1000 } else { timeout };
        m.timeout = Duration::from_millis(ms.unsigned_abs());
        Ok(m)
    }
}

/// How a migration failed, as the client is told.
enum Failure {
    /// Over TLS, with nothing to verify the target with.
    Unverifiable(&'static str),
    Connect,
    Write(io::Error),
    Read(io::Error),
    /// The target refused a request; its error.
    Refused(String),
    /// Reading a value from the store failed.
    Store(io::Error),
}

impl KvService {
    /// `MIGRATE` (see [`Migration::of`]): `NOKEY` when none of the keys is held, `OK`
    /// once the target took them all (removed here, unless `COPY`), else the first error.
    pub(super) fn migrate(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        let m = match Migration::of(args) {
            Ok(m) => m,
            Err(e) => return reply::error(out, e),
        };
        let held: Vec<(&[u8], Arc<Extents>, Option<u64>)> = {
            let ix = self.lock();
            (m.keys.iter())
                .filter_map(|k| ix.peek(k).map(|(v, d)| (*k, v, d)))
                .collect()
        };
        if held.is_empty() {
            return reply::simple(out, "NOKEY");
        }
        match self.send_keys(&m, &held) {
            Ok(()) => reply::ok(out),
            Err(Failure::Unverifiable(e)) => reply::error(out, &format!("ERR {e}")),
            Err(Failure::Connect) => {
                reply::error(out, "IOERR error or timeout connecting to the client")
            }
            Err(Failure::Write(_)) => {
                reply::error(out, "IOERR error or timeout writing to target instance")
            }
            Err(Failure::Read(_)) => {
                reply::error(out, "IOERR error or timeout reading to target instance")
            }
            Err(Failure::Refused(e)) => {
                reply::error(out, &format!("ERR Target instance replied with error: {e}"))
            }
            Err(Failure::Store(e)) => {
                self.counters.storage_errors.fetch_add(1, Relaxed);
                reply::error(out, &format!("ERR storage read failed: {e}"));
            }
        }
    }

    /// Sends `held` (key, value, deadline) to the target of `m` (see
    /// [`KvService::send_over`]), over the connection kept from a `MIGRATE` before to
    /// the same place, or a new one; keeps the connection for the next unless it failed.
    fn send_keys(
        &self,
        m: &Migration,
        held: &[(&[u8], Arc<Extents>, Option<u64>)],
    ) -> Result<(), Failure> {
        let kept = self.migrations.take(m.host, m.port);
        let reused = kept.is_some();
        let (mut peer, db) = match kept {
            Some((peer, db)) => {
                peer.wait_at_most(m.timeout).map_err(|_| Failure::Connect)?;
                (peer, Some(db))
            }
            None => (self.connect_for(m)?, None),
        };
        let mut answered = false;
        let mut sent = self.send_over(&mut peer, m, held, db, &mut answered);
        // A connection kept may have been closed by the target since (its idle clients'
        // timeout, a restart): tried once more on a new one, as Redis does, where it
        // answered nothing and did not time out (a target that is slow, not gone, may
        // have taken keys it did not answer yet).
        let gone = |e: &io::Error| {
            !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            )
        };
        if reused
            && !answered
            && matches!(&sent, Err(Failure::Write(e) | Failure::Read(e)) if gone(e))
        {
            peer = self.connect_for(m)?;
            sent = self.send_over(&mut peer, m, held, None, &mut answered);
        }
        if matches!(sent, Ok(()) | Err(Failure::Refused(_))) {
            self.migrations.keep(m.host, m.port, peer, m.db);
        }
        sent
    }

    /// A new connection to the target of `m`: over TLS where the service speaks it.
    fn connect_for(&self, m: &Migration) -> Result<Peer, Failure> {
        let host = String::from_utf8_lossy(m.host);
        let port = std::str::from_utf8(m.port)
            .ok()
            .and_then(|p| p.parse::<u16>().ok());
        let addr = port
            .and_then(|p| (host.as_ref(), p).to_socket_addrs().ok()?.next())
            .ok_or(Failure::Connect)?;
        let tls = match self.peer_tls().map_err(Failure::Unverifiable)? {
            // The name the target's certificate must carry: the host as given.
            Some(config) => {
                let name = ServerName::try_from(host.into_owned()).map_err(|_| Failure::Connect)?;
                Some((config, name))
            }
            None => None,
        };
        Peer::connect(addr, tls, m.timeout).map_err(|_| Failure::Connect)
    }

    /// Sends `held` over `peer` (its database `db`, where it has selected one), a share
    /// of their values at a time, and reads each share's replies; removes each key the
    /// target took (unless `COPY`) if it still holds the value sent. The first refusal is
    /// the failure, after the rest of the replies are read. `answered` says whether the
    /// target answered anything.
    fn send_over(
        &self,
        peer: &mut Peer,
        m: &Migration,
        held: &[(&[u8], Arc<Extents>, Option<u64>)],
        db: Option<i64>,
        answered: &mut bool,
    ) -> Result<(), Failure> {
        let mut out = Vec::new();
        if !m.auth.is_empty() {
            request(
                &mut out,
                [&b"AUTH"[..]].into_iter().chain(m.auth.iter().copied()),
            );
        }
        let select = db != Some(m.db);
        if select {
            request(&mut out, [&b"SELECT"[..], m.db.to_string().as_bytes()]);
        }
        let opening = usize::from(select) + usize::from(!m.auth.is_empty());
        let mut refused = None;
        let mut awaited = opening;
        let restore: &[u8] = match self.cluster() {
            Some(_) => b"RESTORE-ASKING",
            None => b"RESTORE",
        };
        let mut rest = held;
        while !rest.is_empty() || awaited > 0 {
            // A share: the keys up to about SHARE bytes of values, at least one.
            let mut bytes = 0;
            let n = rest
                .iter()
                .take_while(|(_, v, _)| {
                    let first = bytes == 0;
                    bytes += v.len();
                    first || bytes <= SHARE
                })
                .count();
            let (share, after) = rest.split_at(n);
            rest = after;
            let values: Vec<&Extents> = share.iter().map(|(_, v, _)| &**v).collect();
            let read = self.read_all(&values).map_err(Failure::Store)?;
            let now = u64::try_from(now_ms()).unwrap_or(0);
            let mut sent = Vec::new();
            for ((key, value, deadline), bytes) in share.iter().zip(read) {
                // Gone meanwhile (its time passed), or its bytes no longer its own.
                let left = match deadline {
                    Some(d) if *d < now => continue,
                    Some(d) => (d - now).max(1),
                    None => 0,
                };
                let Some(bytes) = bytes else { continue };
                let left = left.to_string();
                let payload = dump::encode(&bytes);
                let mut words = vec![restore, key, left.as_bytes(), &payload];
                if m.replace {
                    words.push(b"REPLACE");
                }
                request(&mut out, words);
                sent.push((*key, value));
            }
            peer.stream.write_all(&out).map_err(Failure::Write)?;
            out.clear();
            for _ in 0..std::mem::take(&mut awaited) {
                let answer = peer.answer().map_err(Failure::Read)?;
                *answered = true;
                if let Answer::Error(e) = answer {
                    refused.get_or_insert(e);
                }
            }
            for (key, value) in sent {
                let answer = peer.answer().map_err(Failure::Read)?;
                *answered = true;
                match answer {
                    Answer::Error(e) => {
                        refused.get_or_insert(e);
                    }
                    _ if m.copy => {}
                    _ => {
                        self.lock().remove_value(key, value);
                    }
                }
            }
        }
        refused.map_or(Ok(()), |e| Err(Failure::Refused(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<&[u8]> {
        text.split(' ')
            .map(|w| if w == "''" { &b""[..] } else { w.as_bytes() })
            .collect()
    }

    #[test]
    fn keys_are_found_as_redis_finds_them() {
        for (request, places) in [
            ("MIGRATE h 1 k 0 5", vec![3]),
            ("MIGRATE h 1 '' 0 5 COPY KEYS a b", vec![8, 9]),
            ("MIGRATE h 1 '' 0 5 AUTH keys KEYS a", vec![9]),
            ("MIGRATE h 1 '' 0 5 AUTH2 u keys KEYS a b", vec![10, 11]),
            ("MIGRATE h 1 k 0 5 KEYS a", vec![]),
            ("MIGRATE h 1 k 0 5 REPLACE", vec![3]),
        ] {
            assert_eq!(key_places(&words(request)), places, "{request}");
        }
    }

    #[test]
    fn requests_are_read_as_redis_reads_them() {
        let m = Migration::of(&words("h 1 '' 3 0 COPY AUTH2 u p KEYS a b")[..])
            .ok()
            .unwrap();
        assert_eq!(
            (m.db, m.timeout, m.copy, m.replace),
            (3, Duration::from_secs(1), true, false)
        );
        assert_eq!(m.auth, [&b"u"[..], b"p"]);
        assert_eq!(m.keys, [&b"a"[..], b"b"]);
        for (request, error) in [
            ("h 1 k 0 5 FOO", "ERR syntax error"),
            ("h 1 k 0 5 AUTH", "ERR syntax error"),
            ("h 1 k 0 5 AUTH2 u", "ERR syntax error"),
            ("h 1 k 0 x", "ERR value is not an integer or out of range"),
            ("h 1 k x 5", "ERR value is not an integer or out of range"),
        ] {
            assert_eq!(
                Migration::of(&words(request)).err(),
                Some(error),
                "{request}"
            );
        }
        let keys_with_key = Migration::of(&words("h 1 k 0 5 KEYS a")).err().unwrap();
        assert!(keys_with_key.contains("must be set to the empty string"));
    }
}
