//! The requests that are not a value's I/O: options, deadlines, `SCAN`, `CONFIG`,
//! authentication, `HELLO`, `INFO`, the connections (`CLIENT`), and the counts of each
//! command.

use super::catalog::{self, Subcommand, CATALOG, SUBCOMMANDS};
use super::clients::{self, Attribute, ClientInfo, KillFilter, BAD_NAME};
use super::cluster;
use super::transaction;
use super::values::{Expiry, Only, Storing};
use super::{now_ms, KvService, Replies, Session, COMMANDS, SERVED, TIMED};
use crate::kvcache::glob;
use crate::kvcache::index::StoreError;
use crate::kvcache::keys::WalkStep;
use crate::kvcache::resp::{reply, Proto};
use crate::kvcache::storage;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::TryLockError;
use std::time::Instant;

/// `COMMAND LIST [FILTERBY MODULE name | ACLCAT category | PATTERN pattern]`: the names
/// of the commands served, or of those the filter keeps, as Redis 7 reads it.
fn command_list(args: &[&[u8]], out: &mut Vec<u8>) {
    let keep: Box<dyn Fn(&catalog::Command) -> bool> = match args {
        [] => Box::new(|_| true),
        [by, kind, value] if by.eq_ignore_ascii_case(b"filterby") => {
            let value = value.to_ascii_lowercase();
            match kind.to_ascii_lowercase().as_slice() {
                // No modules are loaded.
                b"module" => Box::new(|_| false),
                b"aclcat" => Box::new(move |c| {
                    (c.traits.acl.split_whitespace()).any(|a| a.as_bytes()[1..] == value[..])
                }),
                b"pattern" => Box::new(move |c| glob::matches(&value, c.name.as_bytes())),
                _ => return reply::error(out, "ERR syntax error"),
            }
        }
        _ => return reply::error(out, "ERR syntax error"),
    };
    let names: Vec<&str> = CATALOG.iter().filter(|c| keep(c)).map(|c| c.name).collect();
    reply::array(out, names.len());
    for n in names {
        reply::bulk(out, n.as_bytes());
    }
}

/// `COMMAND GETKEYS command [arg …]`: the keys of that request, found where the command's
/// key specification says; errors as Redis 7's.
fn command_getkeys(words: &[&[u8]], out: &mut Vec<u8>) {
    let name = String::from_utf8_lossy(words[0]).to_ascii_lowercase();
    let Some((arity, traits)) = catalog::lookup(&name, words.get(1).copied()) else {
        return reply::error(out, "ERR Invalid command specified");
    };
    if !catalog::arity_holds(arity, words.len()) {
        return reply::error(out, "ERR Invalid number of arguments specified for command");
    }
    let places = traits.key_places(words).unwrap_or_default();
    if places.is_empty() {
        return reply::error(out, "ERR The command has no key arguments");
    }
    reply::array(out, places.len());
    for i in places {
        reply::bulk(out, words[i]);
    }
}

/// Whether `a` and `b` are equal, in a time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// An integer argument as Redis reads one: an optional minus and digits, no leading zero,
/// within 64 bits.
pub(super) fn integer(arg: &[u8]) -> Option<i64> {
    let digits = arg.strip_prefix(b"-").unwrap_or(arg);
    let canonical = match digits {
        [] => false,
        [b'0'] => digits.len() == arg.len(),
        [first, ..] => *first != b'0' && digits.iter().all(u8::is_ascii_digit),
    };
    canonical
        .then(|| std::str::from_utf8(arg).ok()?.parse().ok())
        .flatten()
}

/// A `SCAN` cursor as Redis reads one (C's `strtoul`): digits after an optional sign, a
/// minus wrapping around.
fn cursor_of(arg: &[u8]) -> Option<u64> {
    let (minus, digits) = match arg {
        [b'-', rest @ ..] => (true, rest),
        [b'+', rest @ ..] => (false, rest),
        _ => (false, arg),
    };
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(if minus { n.wrapping_neg() } else { n })
}

/// Redis's error for a command it does not know: the name as sent and the first
/// arguments, each quoted, as much of them as fits in 128 bytes.
pub(super) fn unknown_command(name: &[u8], args: &[&[u8]]) -> String {
    const SHOWN: usize = 128;
    let name = String::from_utf8_lossy(&name[..name.len().min(SHOWN)]);
    let mut shown = Vec::new();
    for a in args {
        if shown.len() >= SHOWN {
            break;
        }
        let room = SHOWN - shown.len();
        shown.push(b'\'');
        shown.extend_from_slice(&a[..a.len().min(room)]);
        shown.extend_from_slice(b"' ");
    }
    let shown = String::from_utf8_lossy(&shown);
    format!("ERR unknown command '{name}', with args beginning with: {shown}")
}

/// The sections of `info` (`# Name` and its lines, a blank line between sections) that
/// `INFO section …` asks for, as Redis gives them: all of them for `all` or `everything`,
/// all but commandstats for none or `default`; nothing for a section there is not.
fn info_sections(info: &str, wanted: &[&[u8]]) -> String {
    let asked = |words: &[&[u8]]| {
        wanted
            .iter()
            .any(|w| words.iter().any(|a| w.eq_ignore_ascii_case(a)))
    };
    let all = asked(&[b"all", b"everything"]);
    let default = wanted.is_empty() || asked(&[b"default"]);
    let sections: Vec<&str> = info
        .split("\r\n\r\n")
        .map(|s| s.trim_end_matches("\r\n"))
        .filter(|s| {
            let name = s.lines().next().and_then(|l| l.strip_prefix("# "));
            all || name.is_some_and(|n| (default && n != "Commandstats") || asked(&[n.as_bytes()]))
        })
        .collect();
    match sections.is_empty() {
        true => String::new(),
        false => sections.join("\r\n\r\n") + "\r\n",
    }
}

/// Whether `MEMORY USAGE`'s options are none or `SAMPLES count`, or Redis's error.
fn samples(options: &[&[u8]]) -> Result<(), &'static str> {
    match options {
        [] => Ok(()),
        [word, count] if word.eq_ignore_ascii_case(b"samples") => match integer(count) {
            Some(_) => Ok(()),
            None => Err("ERR value is not an integer or out of range"),
        },
        _ => Err("ERR syntax error"),
    }
}

/// The options of `SET` (`NX`, `XX`, `GET`, `KEEPTTL`) or `GETEX` (`PERSIST`), and of
/// both an expiry (`EX`, `PX`, `EXAT`, `PXAT` and its amount), read as Redis reads them:
/// an option may come again, an expiry again in its own unit (the last amount counts),
/// conflicting ones are a syntax error, and the amount is not read yet.
#[derive(Debug, Default)]
struct StringOptions<'a> {
    only: Only,
    get: bool,
    keep: bool,
    persist: bool,
    expire: Option<((bool, bool), &'a [u8])>,
}

impl<'a> StringOptions<'a> {
    /// `None` for a syntax error.
    fn of(opts: &[&'a [u8]], set: bool) -> Option<StringOptions<'a>> {
        let mut o = StringOptions::default();
        let mut words = opts.iter();
        while let Some(w) = words.next() {
            match w.to_ascii_lowercase().as_slice() {
                b"nx" if set && !matches!(o.only, Only::Present) => o.only = Only::Absent,
                b"xx" if set && !matches!(o.only, Only::Absent) => o.only = Only::Present,
                b"get" if set => o.get = true,
                b"keepttl" if set && o.expire.is_none() => o.keep = true,
                b"persist" if !set && o.expire.is_none() => o.persist = true,
                w => {
                    let unit = expiry_unit(w)?;
                    if o.keep || o.persist || o.expire.is_some_and(|(u, _)| u != unit) {
                        return None;
                    }
                    o.expire = Some((unit, words.next()?));
                }
            }
        }
        Some(o)
    }
}

/// The deadline (unix milliseconds) `amount` of `unit` gives at `now`: relative for
/// `EX`/`PX`/`EXPIRE`/`PEXPIRE`, absolute for the `…AT` forms; `None` past 64 bits
/// (Redis's "invalid expire time").
fn deadline_of(amount: i64, seconds: bool, relative: bool, now: i64) -> Option<i64> {
    let ms = if seconds {
        amount.checked_mul(1000)?
    } else {
        amount
    };
    if relative {
        ms.checked_add(now)
    } else {
        Some(ms)
    }
}

/// What an expiry option of `SET` or `GETEX` (lower case) counts in: (seconds, relative to
/// now), for `EX`, `PX`, `EXAT` and `PXAT`.
fn expiry_unit(option: &[u8]) -> Option<(bool, bool)> {
    match option {
        b"ex" => Some((true, true)),
        b"px" => Some((false, true)),
        b"exat" => Some((true, false)),
        b"pxat" => Some((false, false)),
        _ => None,
    }
}

/// The deadline an expiry option's `amount` in `unit` ([`expiry_unit`]) gives at `now`, or
/// Redis's error for `command`: the amount must be a positive integer within 64 bits.
fn option_deadline(
    command: &str,
    (seconds, relative): (bool, bool),
    amount: &[u8],
    now: i64,
) -> Result<i64, String> {
    let amount = integer(amount).ok_or("ERR value is not an integer or out of range")?;
    deadline_of(amount, seconds, relative, now)
        .filter(|_| amount > 0)
        .ok_or_else(|| format!("ERR invalid expire time in '{command}' command"))
}

/// The reply to a value the store cannot take.
pub(super) fn refusal(e: &StoreError) -> String {
    match e {
        StoreError::TooLarge { .. } => format!("ERR {e}"),
        // Redis's answer when a write finds no room.
        StoreError::Busy => format!("OOM {e}"),
    }
}

impl KvService {
    /// Accounts for `n` requests of `name` served together since `since` (a run of
    /// pipelined GETs or SETs, whose time is each one's): INFO's counts, the command's
    /// duration histogram where it has one, and the slow log, given the request's `args`
    /// and `others` as [`super::slowlog::SlowLog::note`] takes them; what carries a password is never
    /// logged.
    pub(super) fn finished<'a>(
        &self,
        name: &str,
        n: usize,
        since: Instant,
        args: impl IntoIterator<Item = &'a [u8]>,
        others: Option<(usize, &str)>,
        client: &ClientInfo,
    ) {
        let took = since.elapsed();
        let n = n as u64;
        // The forms of a command are counted as one.
        let command = match name {
            "getdel" | "getex" => "get",
            "setex" | "psetex" | "setnx" | "getset" => "set",
            "pexpire" | "expireat" | "pexpireat" => "expire",
            "pttl" | "expiretime" | "pexpiretime" => "ttl",
            c => c,
        };
        let i = COMMANDS
            .iter()
            .position(|c| *c == command)
            .unwrap_or(COMMANDS.len() - 1);
        let c = &self.counters;
        c.commands[i].fetch_add(n, Relaxed);
        if let Ok(i) = SERVED.binary_search(&name) {
            c.calls.0[i].fetch_add(n, Relaxed);
            let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
            c.call_ns.0[i].fetch_add(ns, Relaxed);
        }
        if let Some(i) = TIMED.iter().position(|c| *c == name) {
            c.durations[i].observe_n(took, n);
        }
        // As Redis: a transaction's requests are logged, not its `EXEC` (`skip_slowlog`).
        if !matches!(name, "auth" | "hello" | "exec") {
            self.slowlog.note(took, args, others, client);
        }
    }

    /// Runs one request of the connection `s`, appending its reply to `out` in the
    /// connection's protocol (which `HELLO` changes); `true` when the client asked to
    /// leave.
    pub(super) fn execute(&self, words: &[&[u8]], out: &mut Replies, s: &mut Session) -> bool {
        let p = s.proto;
        let Some((name, args)) = words.split_first() else {
            return false;
        };
        let name = String::from_utf8_lossy(name).to_ascii_lowercase();
        let arity = |n: usize, out: &mut Vec<u8>| {
            let ok = args.len() == n;
            if !ok {
                reply::error(
                    out,
                    &format!("ERR wrong number of arguments for '{name}' command"),
                );
            }
            ok
        };
        let since = Instant::now();
        let mut leaving = false;
        let replied = out.len();
        // Before it runs: `CLIENT LIST` names itself as the command of its connection.
        s.client.served(&name);
        // As Redis, not served: counted apart, neither logged nor shown.
        if let Some(e) = self.redirection(&name, words) {
            self.counters.redirected.fetch_add(1, Relaxed);
            reply::error(out, &e);
            if let Some(queued) = &mut s.transaction {
                queued.refuse();
            }
            return false;
        }
        if s.transaction.is_some() && !transaction::served_at_once(&name) {
            self.queue(&name, words, out, s);
            return false;
        }
        match name.as_str() {
            "get" => {
                if arity(1, out) {
                    self.get(args[0], out, p);
                }
            }
            "set" => self.set_command(args, out, p),
            "setex" | "psetex" | "setnx" | "getset" => self.set_form(&name, args, out, p),
            "getdel" => {
                if arity(1, out) {
                    self.getdel(args[0], out, p);
                }
            }
            "getex" => self.getex(args, out, p),
            "dump" => {
                if arity(1, out) {
                    self.dump(args[0], out, p);
                }
            }
            "restore" | "restore-asking" => self.restores(&[words], out),
            "migrate" => self.migrate(args, out),
            "multi" | "exec" | "discard" if !args.is_empty() => {
                self.transaction_arity(&name, out, s);
            }
            "watch" if !args.is_empty() => self.watch(args, out, s),
            "unwatch" => {
                if arity(0, out) {
                    s.watched.clear();
                    reply::ok(out);
                }
            }
            "multi" => self.multi(out, s),
            "exec" => self.exec(out, s),
            "discard" => self.discard(out, s),
            // Typed by hand, or while someone watches (`MONITOR`); otherwise MGET is
            // served as it is read, its values sent as they come (`talk`).
            "mget" if !args.is_empty() => {
                reply::array(out, args.len());
                let mut served = 0;
                while served < args.len() {
                    served += self.values_share(&args[served..], out, p);
                }
            }
            "mset" if !args.is_empty() && args.len() % 2 == 0 => {
                let pairs: Vec<_> = args
                    .chunks(2)
                    .map(|kv| Storing::set(kv[0], kv[1]))
                    .collect();
                let failed = self
                    .store_all(&pairs)
                    .into_iter()
                    .rev()
                    .find_map(Result::err);
                match failed {
                    None => reply::ok(out),
                    Some(e) => reply::error(out, &e),
                }
            }
            "del" | "unlink" if !args.is_empty() => {
                let mut ix = self.lock();
                let n = args.iter().filter(|k| ix.remove(k)).count();
                reply::integer(out, n as i64);
            }
            "exists" if !args.is_empty() => {
                let ix = self.lock();
                let n = args.iter().filter(|k| ix.contains(k)).count();
                reply::integer(out, n as i64);
            }
            "strlen" => {
                if arity(1, out) {
                    let len = self.lock().len_of(args[0]).unwrap_or(0);
                    reply::integer(out, len as i64);
                }
            }
            // Every value is a string (what `redis-cli --bigkeys` asks of each key).
            "type" => {
                if arity(1, out) {
                    let held = self.lock().contains(args[0]);
                    reply::simple(out, if held { "string" } else { "none" });
                }
            }
            "dbsize" => {
                if arity(0, out) {
                    reply::integer(out, self.lock().stats().keys as i64);
                }
            }
            "expire" | "pexpire" | "expireat" | "pexpireat" => self.expire(&name, args, out),
            "ttl" | "pttl" | "expiretime" | "pexpiretime" => {
                if arity(1, out) {
                    self.ttl(&name, args[0], out);
                }
            }
            "persist" => {
                if arity(1, out) {
                    let mut ix = self.lock();
                    let had = matches!(ix.deadline(args[0]), Some(Some(_)));
                    if had {
                        ix.set_deadline(args[0], None);
                    }
                    reply::integer(out, i64::from(had));
                }
            }
            "keys" => {
                if arity(1, out) {
                    self.keys_command(args[0], out);
                }
            }
            "scan" => self.scan(args, out),
            "flushall" | "flushdb" => {
                let mode = match args {
                    [] => true,
                    [m] => m.eq_ignore_ascii_case(b"sync") || m.eq_ignore_ascii_case(b"async"),
                    _ => false,
                };
                // A mistyped option flushes nothing.
                if mode {
                    self.lock().clear();
                    reply::ok(out);
                } else {
                    reply::error(out, "ERR syntax error");
                }
            }
            "save" => {
                if arity(0, out) {
                    self.save_command(out);
                }
            }
            "lastsave" => {
                if arity(0, out) {
                    let ms = self.counters.last_save_ms.load(Relaxed);
                    reply::integer(out, i64::try_from(ms / 1000).unwrap_or(i64::MAX));
                }
            }
            "ping" => match args {
                [] => reply::simple(out, "PONG"),
                [msg] => reply::bulk(out, msg),
                _ => {
                    arity(1, out);
                }
            },
            "echo" => {
                if arity(1, out) {
                    reply::bulk(out, args[0]);
                }
            }
            "quit" => {
                reply::ok(out);
                leaving = true;
            }
            "monitor" => {
                if arity(0, out) {
                    reply::ok(out);
                    // Watching from now: what comes after this reply is streamed.
                    s.monitoring = Some(self.monitors.watch(s.client.id));
                }
            }
            "select" => match args {
                [b"0"] => reply::ok(out),
                [_] => reply::error(out, "ERR DB index is out of range"),
                _ => {
                    arity(1, out);
                }
            },
            "info" => reply::text(out, info_sections(&self.info(), args).as_bytes(), p),
            "asking" | "readonly" | "readwrite" if self.cluster().is_none() && args.is_empty() => {
                reply::error(out, "ERR This instance has cluster support disabled");
            }
            // Every node serves its slots' keys to any client that asks.
            "asking" | "readonly" | "readwrite" => {
                if arity(0, out) {
                    reply::ok(out);
                }
            }
            "client" | "cluster" | "command" | "config" | "latency" | "memory" | "slowlog" => {
                self.subcommand(&name, args, out, s)
            }
            "auth" => match self.auth(args) {
                Ok(()) => reply::ok(out),
                Err(e) => reply::error(out, e),
            },
            "hello" => self.hello_command(args, out, s),
            "mget" | "mset" | "del" | "unlink" | "exists" | "watch" => {
                reply::error(
                    out,
                    &format!("ERR wrong number of arguments for '{name}' command"),
                );
            }
            _ => {
                reply::error(out, &unknown_command(words[0], args));
            }
        }
        self.finished(&name, 1, since, words.iter().copied(), None, &s.client);
        // Shown as Redis shows what it ran: not a command it does not know, nor one whose
        // arguments it did not count right.
        if self.monitors.watching()
            && SERVED.binary_search(&name.as_str()).is_ok()
            && !out[replied..].starts_with(b"-ERR wrong number of arguments")
            && !out[replied..].starts_with(b"-ERR unknown subcommand")
        {
            self.show(words, &s.client);
        }
        leaving
    }

    /// Offers a request served to those watching (`MONITOR`), stamped now.
    pub(super) fn show(&self, words: &[&[u8]], client: &ClientInfo) {
        let unix_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        self.monitors.offer(words, client, unix_us);
    }

    /// `SET key value [NX | XX] [GET] [EX s | PX ms | EXAT unix-s | PXAT unix-ms | KEEPTTL]`,
    /// as Redis 7 reads it: a deadline already passed stores nothing and removes the key.
    fn set_command(&self, args: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let [key, value, opts @ ..] = args else {
            reply::error(out, "ERR wrong number of arguments for 'set' command");
            return;
        };
        let Some(o) = StringOptions::of(opts, true) else {
            reply::error(out, "ERR syntax error");
            return;
        };
        self.set_and_reply("set", key, value, o, out, proto);
    }

    /// The older forms of `SET`, as Redis 7 answers them: `SETEX key seconds value` and
    /// `PSETEX key ms value` (`SET … EX`/`PX`), `SETNX key value` (`SET … NX`, answered 1
    /// or 0), `GETSET key value` (`SET … GET`).
    fn set_form(&self, name: &str, args: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let mut o = StringOptions::default();
        let (key, value) = match (name, args) {
            ("setex" | "psetex", [key, amount, value]) => {
                o.expire = Some(((name == "setex", true), *amount));
                (key, value)
            }
            ("setnx", [key, value]) => {
                o.only = Only::Absent;
                (key, value)
            }
            ("getset", [key, value]) => {
                o.get = true;
                (key, value)
            }
            _ => {
                let msg = format!("ERR wrong number of arguments for '{name}' command");
                reply::error(out, &msg);
                return;
            }
        };
        self.set_and_reply(name, key, value, o, out, proto);
    }

    /// [`KvService::set_with`], answered as `command` is: the value the key held for
    /// `GET`, 1 or 0 for `SETNX`, else `OK` or, when `NX`/`XX` kept it from storing, null.
    fn set_and_reply(
        &self,
        command: &str,
        key: &[u8],
        value: &[u8],
        o: StringOptions,
        out: &mut Vec<u8>,
        proto: Proto,
    ) {
        match self.set_with(command, key, value, o, proto) {
            Err(e) => reply::error(out, &e),
            Ok((_, Some(old))) => out.extend_from_slice(&old),
            Ok((stored, None)) if command == "setnx" => reply::integer(out, i64::from(stored)),
            Ok((true, None)) => reply::ok(out),
            Ok((false, None)) => reply::null(out, proto),
        }
    }

    /// Stores `value` as `key`'s under the options `o` of `command` (a form of `SET`):
    /// whether it was stored, and with `GET` the reply of the value the key held; or the
    /// error to answer.
    fn set_with(
        &self,
        command: &str,
        key: &[u8],
        value: &[u8],
        o: StringOptions,
        proto: Proto,
    ) -> Result<(bool, Option<Vec<u8>>), String> {
        let expiry = match o.expire {
            Some((unit, amount)) => Expiry::At(option_deadline(command, unit, amount, now_ms())?),
            None if o.keep => Expiry::Keep,
            None => Expiry::Clear,
        };
        let (only, get) = (o.only, o.get);
        // `GET`: the reply is the value the key held, read before anything is stored (so
        // its blocks are not held while the new value needs room), whether or not `NX` or
        // `XX` let the SET store.
        let old = get.then(|| {
            let mut old = Vec::new();
            let extents = self.lock().get(key);
            self.reply_value(key, extents, &mut old, proto);
            old
        });
        let stored = match expiry {
            Expiry::At(at) if at <= now_ms() => {
                // Stored and at once expired, as Redis has it: the key is gone.
                let mut ix = self.lock();
                let allowed = only.allows(ix.contains(key));
                if allowed {
                    ix.remove(key);
                }
                Ok(allowed)
            }
            _ => self.store(key, value, only, expiry),
        };
        Ok((stored?, old))
    }

    /// `EXPIRE key seconds`, `PEXPIRE key ms`, `EXPIREAT key unix-s`, `PEXPIREAT key
    /// unix-ms`, each with `NX | XX | GT | LT` as Redis 7 has them (a key without a
    /// deadline counts as never expiring for `GT` and `LT`); a deadline already passed
    /// removes the key. 1 when the deadline was set (or the key removed), 0 otherwise.
    pub(super) fn expire(&self, name: &str, args: &[&[u8]], out: &mut Vec<u8>) {
        let [key, amount, opts @ ..] = args else {
            reply::error(
                out,
                &format!("ERR wrong number of arguments for '{name}' command"),
            );
            return;
        };
        // The options are read before the amount, as Redis reads them.
        let (mut nx, mut xx, mut gt, mut lt) = (false, false, false, false);
        for o in opts {
            match o.to_ascii_lowercase().as_slice() {
                b"nx" => nx = true,
                b"xx" => xx = true,
                b"gt" => gt = true,
                b"lt" => lt = true,
                _ => {
                    let o = String::from_utf8_lossy(o);
                    reply::error(out, &format!("ERR Unsupported option {o}"));
                    return;
                }
            }
        }
        if nx && (xx || gt || lt) {
            reply::error(
                out,
                "ERR NX and XX, GT or LT options at the same time are not compatible",
            );
            return;
        }
        if gt && lt {
            reply::error(
                out,
                "ERR GT and LT options at the same time are not compatible",
            );
            return;
        }
        let Some(amount) = integer(amount) else {
            reply::error(out, "ERR value is not an integer or out of range");
            return;
        };
        let seconds = matches!(name, "expire" | "expireat");
        let relative = matches!(name, "expire" | "pexpire");
        let now = now_ms();
        let Some(at) = deadline_of(amount, seconds, relative, now) else {
            reply::error(out, &format!("ERR invalid expire time in '{name}' command"));
            return;
        };
        let mut ix = self.lock();
        let Some(current) = ix.deadline(key) else {
            drop(ix);
            reply::integer(out, 0);
            return;
        };
        let current = current.map(|d| i64::try_from(d).unwrap_or(i64::MAX));
        // XX and GT (or LT) together must both hold, as in Redis.
        let allowed = match current {
            _ if nx => current.is_none(),
            None => !xx && !gt,
            Some(c) => !(gt && at <= c || lt && at >= c),
        };
        if allowed {
            if at <= now {
                ix.remove(key);
            } else {
                ix.set_deadline(key, u64::try_from(at).ok());
            }
        }
        drop(ix);
        reply::integer(out, i64::from(allowed));
    }

    /// `TTL` and `PTTL` (what is left, seconds rounded), `EXPIRETIME` and `PEXPIRETIME`
    /// (the deadline, unix time): -2 for a key not held, -1 for one without a deadline.
    pub(super) fn ttl(&self, name: &str, key: &[u8], out: &mut Vec<u8>) {
        let deadline = self.lock().deadline(key);
        let n = match deadline {
            None => -2,
            Some(None) => -1,
            Some(Some(d)) => {
                let d = i64::try_from(d).unwrap_or(i64::MAX);
                let ms = match name {
                    "ttl" | "pttl" => d.saturating_sub(now_ms()).max(0),
                    _ => d,
                };
                match name {
                    "ttl" | "expiretime" => ms.saturating_add(500) / 1000,
                    _ => ms,
                }
            }
        };
        reply::integer(out, n);
    }

    /// `GETDEL key`: the value, and the key gone, at once (the blocks stay readable to
    /// this request through its own reference).
    fn getdel(&self, key: &[u8], out: &mut Vec<u8>, proto: Proto) {
        let extents = {
            let mut ix = self.lock();
            let extents = ix.get(key);
            ix.remove(key);
            extents
        };
        self.reply_value(key, extents, out, proto);
    }

    /// `GETEX key [EX s | PX ms | EXAT unix-s | PXAT unix-ms | PERSIST]`: the value, its
    /// deadline set or taken away at once; a deadline already past removes the key.
    fn getex(&self, args: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let Some((key, opts)) = args.split_first() else {
            reply::error(out, "ERR wrong number of arguments for 'getex' command");
            return;
        };
        let Some(o) = StringOptions::of(opts, false) else {
            reply::error(out, "ERR syntax error");
            return;
        };
        let now = now_ms();
        let extents = {
            let mut ix = self.lock();
            let extents = ix.get(key);
            // The amount is read only for a key held, as Redis reads it.
            let change = match o.expire {
                Some(_) if extents.is_none() => None,
                Some((unit, amount)) => match option_deadline("getex", unit, amount, now) {
                    Ok(at) => Some(Some(at)),
                    Err(e) => {
                        drop(ix);
                        reply::error(out, &e);
                        return;
                    }
                },
                None => o.persist.then_some(None),
            };
            match change {
                Some(Some(at)) if at <= now => {
                    ix.remove(key);
                }
                Some(at) => {
                    ix.set_deadline(key, at.and_then(|at| u64::try_from(at).ok()));
                }
                None => {}
            }
            extents
        };
        self.reply_value(key, extents, out, proto);
    }

    /// `KEYS pattern`: every key, gathered a map of the index's at a time (see
    /// [`KvService::scan`]) so that requests are not held up while all are looked at.
    fn keys_command(&self, pattern: &[u8], out: &mut Vec<u8>) {
        let mut keys = Vec::new();
        for map in 0.. {
            let Some(found) = self.lock().keys_of_map(map) else {
                break;
            };
            keys.extend(found.into_iter().filter(|k| glob::matches(pattern, k)));
        }
        reply::array(out, keys.len());
        for k in keys {
            reply::bulk(out, &k);
        }
    }

    /// `SCAN cursor [MATCH pattern] [COUNT n] [TYPE type]`. Keys are visited in the order of
    /// a hash fixed for the service's life, and the cursor is the hash to go on from, so
    /// a key held from the first call to the last is returned once, whatever is added or
    /// removed meanwhile (Redis's guarantee). A call reads the hashes kept beside the keys
    /// of one of the index's maps (a 64th of them), or of as many as hold COUNT, and copies
    /// out the COUNT it returns: a walk with `redis-cli --scan` over 200,000 keys took the
    /// lock for 36 ms a call when each call hashed and sorted every key, and every request
    /// waited as long.
    pub(super) fn scan(&self, args: &[&[u8]], out: &mut Vec<u8>) {
        let Some((cursor, opts)) = args.split_first() else {
            reply::error(out, "ERR wrong number of arguments for 'scan' command");
            return;
        };
        let Some(cursor) = cursor_of(cursor) else {
            reply::error(out, "ERR invalid cursor");
            return;
        };
        let (mut pattern, mut count, mut strings) = (&b"*"[..], 10usize, true);
        for opt in opts.chunks(2) {
            match (opt[0].to_ascii_lowercase().as_slice(), opt.get(1)) {
                (b"match", Some(p)) => pattern = p,
                (b"count", Some(n)) => {
                    match integer(n) {
                        Some(n) if n > 0 => count = usize::try_from(n).unwrap_or(usize::MAX),
                        // As Redis answers a count below one.
                        Some(_) => {
                            reply::error(out, "ERR syntax error");
                            return;
                        }
                        None => {
                            reply::error(out, "ERR value is not an integer or out of range");
                            return;
                        }
                    }
                }
                // Every value is a string.
                (b"type", Some(t)) => strings = t.eq_ignore_ascii_case(b"string"),
                _ => {
                    reply::error(out, "ERR syntax error");
                    return;
                }
            }
        }
        let WalkStep { found, more } = self.lock().walk_keys(cursor, count);
        // Zero, the end of the walk, once none are left (no hash follows the largest).
        let cursor = match (more, found.last()) {
            (true, Some(&(last, _))) => last.checked_add(1).unwrap_or(0),
            _ => 0,
        };
        let keys: Vec<&[u8]> = found
            .iter()
            .map(|(_, k)| &k[..])
            .filter(|k| strings && glob::matches(pattern, k))
            .collect();
        reply::array(out, 2);
        reply::bulk(out, cursor.to_string().as_bytes());
        reply::array(out, keys.len());
        for k in keys {
            reply::bulk(out, k);
        }
    }

    /// `CLIENT`, `COMMAND`, `CONFIG`, `LATENCY` and `MEMORY`: what client libraries send on
    /// connecting, what Redis tools (redis-cli, redis_exporter) read of the settings and
    /// the keys, and the connections (`CLIENT LIST`, `KILL`), each subcommand with its
    /// arguments counted as Redis counts them.
    fn subcommand(&self, command: &str, args: &[&[u8]], out: &mut Vec<u8>, s: &Session) {
        let proto = s.proto;
        let Some((sub, rest)) = args.split_first() else {
            match command {
                "command" => self.command_info(&[], out, proto),
                _ => reply::error(
                    out,
                    &format!("ERR wrong number of arguments for '{command}' command"),
                ),
            }
            return;
        };
        let lower = sub.to_ascii_lowercase();
        let full = format!("{command}|{}", String::from_utf8_lossy(&lower));
        if lower == b"help" {
            if command == "cluster" && self.cluster().is_none() {
                return reply::error(out, "ERR This instance has cluster support disabled");
            }
            return self.help(command, rest, out);
        }
        let Some(i) = SUBCOMMANDS.iter().position(|c| c.name == full) else {
            let sub = String::from_utf8_lossy(&sub[..sub.len().min(128)]);
            let help = command.to_ascii_uppercase();
            reply::error(
                out,
                &format!("ERR unknown subcommand '{sub}'. Try {help} HELP."),
            );
            return;
        };
        s.client.serving_subcommand(i);
        let Subcommand { least, most, .. } = SUBCOMMANDS[i];
        if !(least..=most).contains(&rest.len()) {
            let msg = format!("ERR wrong number of arguments for '{full}' command");
            reply::error(out, &msg);
            return;
        }
        match (command, lower.as_slice()) {
            ("client", _) => self.client_command(&lower, rest, out, s),
            ("cluster", _) => self.cluster_command(&lower, rest, out, proto),
            ("command", b"count") => reply::integer(out, SERVED.len() as i64),
            ("command", b"info") => self.command_info(rest, out, proto),
            ("command", b"list") => command_list(rest, out),
            ("command", b"getkeys") => command_getkeys(rest, out),
            // The commands' documentation is not kept.
            ("command", _) => reply::map(out, 0, proto),
            ("config", b"get") => self.config_get(rest, out, proto),
            // Nothing is recorded: Redis's latency monitor as it starts, off.
            ("latency", b"reset") => reply::integer(out, 0),
            ("latency", _) => reply::array(out, 0),
            ("memory", _) => self.memory_usage(rest, out, proto),
            ("slowlog", _) => self.slowlog.command(sub, rest, out),
            _ => reply::error(
                out,
                "ERR the kvcache service's settings live in its pipeline file",
            ),
        }
    }

    /// `command HELP`: its subcommands, how each is called and what it does, as Redis
    /// lists its own.
    fn help(&self, command: &str, args: &[&[u8]], out: &mut Vec<u8>) {
        if !args.is_empty() {
            let e = format!("ERR wrong number of arguments for '{command}|help' command");
            return reply::error(out, &e);
        }
        let upper = command.to_ascii_uppercase();
        let mut lines = vec![format!(
            "{upper} <subcommand> [<arg> [value] [opt] ...]. Subcommands are:"
        )];
        for c in catalog::subcommands_of(command) {
            lines.push(c.usage.to_owned());
            lines.extend(c.what.split('|').map(|l| format!("    {l}")));
        }
        lines.extend(["HELP".to_owned(), "    Prints this help.".to_owned()]);
        reply::array(out, lines.len());
        for l in lines {
            reply::simple(out, &l);
        }
    }

    /// What to answer instead of serving the request of `words` (`name` first) on a node
    /// of a cluster: `CROSSSLOT` or `MOVED` when its keys (where the command's key
    /// specification puts them, in a request of an arity it takes) are not all of one
    /// slot of this node; `None` to serve it.
    fn redirection(&self, name: &str, words: &[&[u8]]) -> Option<String> {
        let cluster = self.cluster()?;
        let (arity, traits) = catalog::lookup(name, words.get(1).copied())?;
        let holds = catalog::arity_holds(arity, words.len());
        let places = traits.key_places(words).filter(|_| holds)?;
        cluster.redirect(words, places.into_iter())
    }

    /// `CLUSTER` and a subcommand of those [`KvService::subcommand`] takes, on a node of a
    /// cluster.
    fn cluster_command(&self, sub: &[u8], args: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let Some(c) = self.cluster() else {
            return reply::error(out, "ERR This instance has cluster support disabled");
        };
        match sub {
            b"countkeysinslot" | b"getkeysinslot" => {
                let Some(slot) = integer(args[0]) else {
                    return reply::error(out, "ERR value is not an integer or out of range");
                };
                let slot = usize::try_from(slot).ok().filter(|&s| s < cluster::SLOTS);
                if sub == b"countkeysinslot" {
                    match slot {
                        Some(slot) => {
                            reply::integer(out, self.keys_in_slot(slot, usize::MAX).len() as i64)
                        }
                        None => reply::error(out, "ERR Invalid slot"),
                    }
                    return;
                }
                let Some(most) = integer(args[1]) else {
                    return reply::error(out, "ERR value is not an integer or out of range");
                };
                match (slot, usize::try_from(most)) {
                    (Some(slot), Ok(most)) => {
                        let keys = self.keys_in_slot(slot, most);
                        reply::array(out, keys.len());
                        for k in keys {
                            reply::bulk(out, &k);
                        }
                    }
                    _ => reply::error(out, "ERR Invalid slot or number of keys"),
                }
            }
            b"info" => reply::text(out, c.info().as_bytes(), proto),
            b"keyslot" => reply::integer(out, cluster::slot(args[0]) as i64),
            b"myid" => reply::bulk(out, c.my_id().as_bytes()),
            b"nodes" => reply::text(out, c.nodes().as_bytes(), proto),
            b"shards" => c.shards(out, proto),
            _ => c.slots(out, proto),
        }
    }

    /// Up to `most` keys held of hash slot `slot`, found among all the keys, a map of the
    /// index at a time (as `KEYS`).
    fn keys_in_slot(&self, slot: usize, most: usize) -> Vec<std::sync::Arc<[u8]>> {
        let mut keys = Vec::new();
        for map in 0.. {
            let Some(found) = self.lock().keys_of_map(map) else {
                break;
            };
            keys.extend(found.into_iter().filter(|k| cluster::slot(k) == slot));
            if keys.len() >= most {
                keys.truncate(most);
                break;
            }
        }
        keys
    }

    /// `COMMAND INFO [name …]`: the entry of each command named (a subcommand as
    /// `command|sub`), null for one not served; with no names, of every command.
    fn command_info(&self, names: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let entry = |out: &mut Vec<u8>, c: &catalog::Command| {
            let subs = catalog::subcommands_of(c.name);
            catalog::describe(out, c.name, c.arity, &c.traits, subs, proto);
        };
        if names.is_empty() {
            reply::array(out, CATALOG.len());
            for c in &CATALOG {
                entry(out, c);
            }
            return;
        }
        reply::array(out, names.len());
        for name in names {
            let name = String::from_utf8_lossy(name).to_ascii_lowercase();
            if let Some(c) = CATALOG.iter().find(|c| c.name == name) {
                entry(out, c);
            } else if let Some(s) = SUBCOMMANDS.iter().find(|s| s.name == name) {
                catalog::describe(out, s.name, s.arity(), &s.traits, &[], proto);
            } else {
                reply::null(out, proto);
            }
        }
    }

    /// `CLIENT` and a subcommand of those [`KvService::subcommand`] takes, for the
    /// connection `s`, its arguments counted.
    fn client_command(&self, sub: &[u8], args: &[&[u8]], out: &mut Vec<u8>, s: &Session) {
        match (sub, args) {
            (b"id", _) => reply::integer(out, s.client.id as i64),
            (b"info", _) => reply::text(out, format!("{}\n", s.client.line()).as_bytes(), s.proto),
            (b"getname", _) => match s.client.name() {
                name if name.is_empty() => reply::null(out, s.proto),
                name => reply::bulk(out, &name),
            },
            (b"setname", [name]) if clients::valid_attribute(name) => {
                s.client.set(Attribute::Name, name);
                reply::ok(out);
            }
            (b"setname", _) => reply::error(out, BAD_NAME),
            (b"setinfo", [attribute, value]) => {
                let which = match attribute.to_ascii_lowercase().as_slice() {
                    b"lib-name" => Attribute::LibName,
                    b"lib-ver" => Attribute::LibVer,
                    _ => {
                        let a = String::from_utf8_lossy(attribute);
                        reply::error(out, &format!("ERR Unrecognized option '{a}'"));
                        return;
                    }
                };
                if clients::valid_attribute(value) {
                    s.client.set(which, value);
                    reply::ok(out);
                } else {
                    let a = String::from_utf8_lossy(attribute);
                    let e =
                        format!("ERR {a} cannot contain spaces, newlines or special characters.");
                    reply::error(out, &e);
                }
            }
            (b"list", _) => self.client_list(args, out, s.proto),
            // The old form: one address, the connection asking among those it may end.
            (b"kill", [addr]) => {
                let only = KillFilter {
                    addr: Some(addr.to_vec()),
                    me_too: true,
                    ..KillFilter::default()
                };
                match self.kill(&only, s) {
                    0 => reply::error(out, "ERR No such client"),
                    _ => reply::ok(out),
                }
            }
            (b"kill", _) => match KillFilter::of(args) {
                Ok(filter) => reply::integer(out, self.kill(&filter, s) as i64),
                Err(e) => reply::error(out, &e),
            },
            _ => unreachable!("`subcommand` takes only these, their arguments counted"),
        }
    }

    /// `CLIENT LIST [TYPE type | ID id …]`: a line for each connection, as Redis reads
    /// the options.
    fn client_list(&self, args: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let mut ids = Vec::new();
        match args {
            [] => {}
            [option, kind] if option.eq_ignore_ascii_case(b"type") => {
                match clients::normal_type(kind) {
                    Ok(true) => {}
                    Ok(false) => return reply::text(out, b"", proto),
                    Err(e) => return reply::error(out, &e),
                }
            }
            [option, listed @ ..] if option.eq_ignore_ascii_case(b"id") && !listed.is_empty() => {
                for id in listed {
                    match integer(id) {
                        Some(id) => ids.push(id),
                        None => return reply::error(out, "ERR Invalid client ID"),
                    }
                }
            }
            _ => return reply::error(out, "ERR syntax error"),
        }
        let mut text = String::new();
        for c in self.clients.all() {
            if ids.is_empty() || ids.contains(&(c.id as i64)) {
                text.push_str(&c.line());
                text.push('\n');
            }
        }
        reply::text(out, text.as_bytes(), proto);
    }

    /// Marks the connections `filter` chooses to end (the connection asking, `s`, after
    /// its reply); how many.
    fn kill(&self, filter: &KillFilter, s: &Session) -> usize {
        let chosen: Vec<_> = self
            .clients
            .all()
            .into_iter()
            .filter(|c| filter.chooses(c, s.client.id))
            .collect();
        for c in &chosen {
            tracing::info!(service = %self.name, client = c.id, addr = %c.addr, "kvcache client killed (CLIENT KILL)");
            c.kill();
        }
        chosen.len()
    }

    /// `MEMORY USAGE key [SAMPLES count]`: the storage a value takes, its blocks on the
    /// target, and its key (what `redis-cli --memkeys` ranks keys by); `SAMPLES` counts
    /// for nothing.
    fn memory_usage(&self, args: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let [key, options @ ..] = args else {
            unreachable!("`subcommand` counted a key at least")
        };
        if let Err(e) = samples(options) {
            reply::error(out, e);
            return;
        }
        match self.lock().blocks_of(key) {
            Some(n) => {
                let bytes = n as u64 * self.config.block_size + key.len() as u64;
                reply::integer(out, i64::try_from(bytes).unwrap_or(i64::MAX));
            }
            None => reply::null(out, proto),
        }
    }

    /// `CONFIG GET pattern …`: the settings a Redis tool reads, as the service has them.
    fn config_get(&self, patterns: &[&[u8]], out: &mut Vec<u8>, proto: Proto) {
        let settings = [
            ("save", String::new()),
            ("appendonly", "no".to_owned()),
            ("maxmemory", self.config.capacity.to_string()),
            ("maxmemory-policy", "allkeys-lru".to_owned()),
            ("maxclients", self.config.max_clients.to_string()),
            (
                "slowlog-log-slower-than",
                self.slowlog.threshold_micros().to_string(),
            ),
            ("slowlog-max-len", super::slowlog::KEPT.to_string()),
            ("databases", "1".to_owned()),
        ];
        let patterns: Vec<Vec<u8>> = patterns.iter().map(|p| p.to_ascii_lowercase()).collect();
        let hits: Vec<_> = settings
            .iter()
            .filter(|(k, _)| patterns.iter().any(|p| glob::matches(p, k.as_bytes())))
            .collect();
        reply::map(out, hits.len(), proto);
        for (k, v) in hits {
            reply::bulk(out, k.as_bytes());
            reply::bulk(out, v.as_bytes());
        }
    }

    /// A request on a connection that has not authenticated: only `AUTH`, `HELLO … AUTH`
    /// and `QUIT` are served (as Redis does with `requirepass`); `true` when the client
    /// asked to leave.
    pub(super) fn unauthenticated(
        &self,
        words: &[&[u8]],
        out: &mut Vec<u8>,
        s: &mut Session,
    ) -> bool {
        let Some((name, args)) = words.split_first() else {
            return false;
        };
        match name.to_ascii_lowercase().as_slice() {
            b"auth" => match self.auth(args) {
                Ok(()) => {
                    s.authed = true;
                    reply::ok(out);
                }
                Err(e) => reply::error(out, e),
            },
            b"hello" => self.hello_command(args, out, s),
            b"quit" => {
                reply::ok(out);
                return true;
            }
            _ => reply::error(out, "NOAUTH Authentication required."),
        }
        false
    }

    /// `AUTH [default] password`.
    pub(super) fn auth(&self, args: &[&[u8]]) -> Result<(), &'static str> {
        let given = match args {
            [p] => p,
            [user, p] if *user == b"default" => p,
            [_, _] => {
                self.counters.auth_failures.fetch_add(1, Relaxed);
                return Err("WRONGPASS invalid username-password pair or user is disabled.");
            }
            [] => return Err("ERR wrong number of arguments for 'auth' command"),
            _ => return Err("ERR syntax error"),
        };
        let Some(password) = &self.password else {
            // As Redis's default user with no password: any password of it will do.
            return match args {
                [_] => Err(
                    "ERR AUTH <password> called without any password configured for \
                     the default user. Are you sure your configuration is correct?",
                ),
                _ => Ok(()),
            };
        };
        if same_secret(given, password) {
            Ok(())
        } else {
            self.counters.auth_failures.fetch_add(1, Relaxed);
            tracing::info!(service = %self.name, "kvcache: a client gave a wrong password");
            Err("WRONGPASS invalid username-password pair or user is disabled.")
        }
    }

    /// `HELLO [2|3 [AUTH user password] [SETNAME name]]`, as Redis 7 reads it: the options
    /// first (a bad name fails there), then the password, then, on an authenticated
    /// connection, its name and protocol set and the server's facts in that protocol.
    fn hello_command(&self, args: &[&[u8]], out: &mut Vec<u8>, s: &mut Session) {
        let mut asked = s.proto;
        if let Some(version) = args.first() {
            asked = match integer(version) {
                Some(2) => Proto::Resp2,
                Some(3) => Proto::Resp3,
                Some(_) => return reply::error(out, "NOPROTO unsupported protocol version"),
                None => {
                    let e = "ERR Protocol version is not an integer or out of range";
                    return reply::error(out, e);
                }
            };
        }
        let (mut password, mut name) = (None, None);
        let mut rest = args.get(1..).unwrap_or_default();
        while let Some((opt, tail)) = rest.split_first() {
            match (opt.to_ascii_lowercase().as_slice(), tail) {
                (b"auth", [user, pass, more @ ..]) => {
                    password = Some([*user, *pass]);
                    rest = more;
                }
                (b"setname", [given, more @ ..]) => {
                    if !clients::valid_attribute(given) {
                        return reply::error(out, BAD_NAME);
                    }
                    name = Some(*given);
                    rest = more;
                }
                _ => {
                    let opt = String::from_utf8_lossy(opt);
                    let e = format!("ERR Syntax error in HELLO option '{opt:.128}'");
                    return reply::error(out, &e);
                }
            }
        }
        if let Some(password) = password {
            if let Err(e) = self.auth(&password) {
                return reply::error(out, e);
            }
            s.authed = true;
        }
        if !s.authed {
            return reply::error(
                out,
                "NOAUTH HELLO must be called with the client already authenticated, otherwise \
                 the HELLO <proto> AUTH <user> <pass> option can be used to authenticate the \
                 client and select the RESP protocol version at the same time",
            );
        }
        if let Some(name) = name {
            s.client.set(Attribute::Name, name);
        }
        s.proto = asked;
        s.client.set_resp(asked);
        self.hello(out, s);
    }

    /// `HELLO`'s reply: the server's facts, a map in the connection's protocol.
    fn hello(&self, out: &mut Vec<u8>, s: &Session) {
        reply::map(out, 7, s.proto);
        for (k, v) in [
            ("server", "dpuflow"),
            ("version", env!("CARGO_PKG_VERSION")),
        ] {
            reply::bulk(out, k.as_bytes());
            reply::bulk(out, v.as_bytes());
        }
        reply::bulk(out, b"proto");
        reply::integer(out, s.proto.version().into());
        reply::bulk(out, b"id");
        reply::integer(out, s.client.id as i64);
        for (k, v) in [("mode", self.mode()), ("role", "master")] {
            reply::bulk(out, k.as_bytes());
            reply::bulk(out, v.as_bytes());
        }
        reply::bulk(out, b"modules");
        reply::array(out, 0);
    }

    /// How Redis names what the service is (`HELLO`'s `mode`, INFO's `redis_mode`).
    fn mode(&self) -> &'static str {
        match self.cluster() {
            Some(_) => "cluster",
            None => "standalone",
        }
    }

    /// `INFO`: Redis's sections that clients read, and the service's own.
    pub(super) fn info(&self) -> String {
        let g = self.gauges();
        let c = &self.counters;
        let changes = (self.lock().changes()).saturating_sub(c.changes_at_last_save.load(Relaxed));
        let saving = matches!(self.checkpoints.try_lock(), Err(TryLockError::WouldBlock));
        let uptime = self.started.elapsed().as_secs();
        // The largest buffers of the connections now (Redis's: of the last few seconds).
        let (input_buffer, output_buffer) = (self.clients.all().iter())
            .map(|c| c.buffers())
            .fold((0, 0), |(i, o), (r, w)| (i.max(r), o.max(w)));
        let last_save = if c.last_save_failed.load(Relaxed) {
            "err"
        } else {
            "ok"
        };
        format!(
            "# Server\r\nredis_version:7.0.0\r\ndpuflow_version:{}\r\nredis_mode:{}\r\n\
             tcp_port:{}\r\nuptime_in_seconds:{}\r\nuptime_in_days:{}\r\n\r\n# Clients\r\nconnected_clients:{}\r\nmaxclients:{}\r\n\
             client_recent_max_input_buffer:{}\r\nclient_recent_max_output_buffer:{}\r\nblocked_clients:0\r\n\r\n\
             # Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:allkeys-lru\r\n\r\n\
             # Stats\r\ntotal_connections_received:{}\r\ntotal_commands_processed:{}\r\n\
             total_net_input_bytes:{}\r\ntotal_net_output_bytes:{}\r\nrejected_connections:{}\r\n\
             keyspace_hits:{}\r\nkeyspace_misses:{}\r\nevicted_keys:{}\r\nexpired_keys:{}\r\n\r\n\
             # Replication\r\nrole:master\r\nconnected_slaves:0\r\n\r\n\
             # Persistence\r\nloading:0\r\nrdb_changes_since_last_save:{}\r\n\
             rdb_bgsave_in_progress:{}\r\nrdb_last_save_time:{}\r\nrdb_last_bgsave_status:{}\r\n\r\n\
             # Kvcache\r\n\
             target:{}\r\nblock_size:{}\r\ncapacity_bytes:{}\r\nused_bytes:{}\r\ninline_bytes:{}\r\n\
             storage_read_bytes:{}\r\nstorage_written_bytes:{}\r\nstorage_errors:{}\r\n\
             corrupt_values:{}\r\nrestored_keys:{}\r\ncheckpoints:{}\r\ncheckpoint_failures:{}\r\n\
             checkpoint_overruns:{}\r\nlast_checkpoint_time:{}\r\n\r\n# Commandstats\r\n{}\r\n\
             # Cluster\r\ncluster_enabled:{}\r\n\r\n\
             # Keyspace\r\ndb0:keys={},expires={},avg_ttl=0\r\n",
            crate::VERSION,
            self.mode(),
            self.listen.port(),
            uptime,
            uptime / 86_400,
            c.clients.load(Relaxed),
            self.config.max_clients,
            input_buffer,
            output_buffer,
            g.used_bytes,
            self.config.capacity,
            c.connections.load(Relaxed),
            c.commands.iter().map(|n| n.load(Relaxed)).sum::<u64>(),
            c.client_read_bytes.load(Relaxed),
            c.client_written_bytes.load(Relaxed),
            c.rejected_clients.load(Relaxed),
            c.hits.load(Relaxed),
            c.misses.load(Relaxed),
            g.evictions,
            g.expired,
            changes,
            u8::from(saving),
            c.last_save_ms.load(Relaxed) / 1000,
            last_save,
            storage::describe_all(&self.config.targets),
            self.config.block_size,
            g.capacity_bytes,
            g.used_bytes,
            g.inline_bytes,
            c.read_bytes.load(Relaxed),
            c.written_bytes.load(Relaxed),
            c.storage_errors.load(Relaxed),
            c.corrupt_values.load(Relaxed),
            self.restored_keys,
            c.checkpoints.load(Relaxed),
            c.checkpoint_failures.load(Relaxed),
            g.hold_back_overruns,
            c.last_save_ms.load(Relaxed) / 1000,
            self.command_stats(),
            u8::from(self.cluster().is_some()),
            g.keys,
            g.expiring,
        )
    }

    /// INFO's commandstats lines (each ending in CRLF), as Redis 6 gives them: each
    /// command served so far, its requests and the time they took.
    fn command_stats(&self) -> String {
        let c = &self.counters;
        let mut lines = String::new();
        for (i, name) in SERVED.iter().enumerate() {
            let calls = c.calls.0[i].load(Relaxed);
            if calls == 0 {
                continue;
            }
            let usec = c.call_ns.0[i].load(Relaxed) / 1000;
            let per_call = usec as f64 / calls as f64;
            lines.push_str(&format!(
                "cmdstat_{name}:calls={calls},usec={usec},usec_per_call={per_call:.2}\r\n"
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_are_read_as_redis_reads_them() {
        assert_eq!(integer(b"0"), Some(0));
        assert_eq!(integer(b"-12"), Some(-12));
        assert_eq!(integer(b"9223372036854775807"), Some(i64::MAX));
        for bad in [
            &b""[..],
            b"-",
            b"-0",
            b"01",
            b"+1",
            b" 1",
            b"1x",
            b"9223372036854775808",
        ] {
            assert_eq!(integer(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn unknown_commands_show_what_fits_of_their_arguments() {
        assert_eq!(
            unknown_command(b"FOO", &[b"a", b"b"]),
            "ERR unknown command 'FOO', with args beginning with: 'a' 'b' "
        );
        let long = [b'x'; 200];
        let msg = unknown_command(&long, &[&long, b"next"]);
        let shown = format!("'{}' ", "x".repeat(128));
        assert!(msg.ends_with(&format!(": {shown}")), "{msg}");
        assert!(
            msg.contains(&format!("command '{}'", "x".repeat(128))),
            "{msg}"
        );
    }

    #[test]
    fn info_gives_the_sections_asked_for() {
        let info = "# Server\r\na:1\r\n\r\n# Stats\r\nb:2\r\n\r\n# Commandstats\r\n\
                    cmdstat_get:calls=1\r\n\r\n# Keyspace\r\ndb0:keys=1\r\n";
        let default = "# Server\r\na:1\r\n\r\n# Stats\r\nb:2\r\n\r\n# Keyspace\r\ndb0:keys=1\r\n";
        assert_eq!(info_sections(info, &[]), default);
        assert_eq!(info_sections(info, &[b"Default"]), default);
        assert_eq!(info_sections(info, &[b"ALL"]), info);
        assert_eq!(info_sections(info, &[b"everything"]), info);
        assert_eq!(
            info_sections(info, &[b"commandstats"]),
            "# Commandstats\r\ncmdstat_get:calls=1\r\n"
        );
        assert_eq!(info_sections(info, &[b"server"]), "# Server\r\na:1\r\n");
        assert_eq!(
            info_sections(info, &[b"keyspace", b"Server"]),
            "# Server\r\na:1\r\n\r\n# Keyspace\r\ndb0:keys=1\r\n"
        );
        assert_eq!(info_sections(info, &[b"nosuch"]), "");
    }

    proptest::proptest! {
        /// A cursor reads as C's `strtoul` reads it: a number with an optional sign, a
        /// minus wrapping; anything else is refused, never a panic.
        #[test]
        fn cursors_read_as_strtoul_reads_them(n: u64, bytes: Vec<u8>) {
            proptest::prop_assert_eq!(cursor_of(n.to_string().as_bytes()), Some(n));
            proptest::prop_assert_eq!(cursor_of(format!("+{n}").as_bytes()), Some(n));
            proptest::prop_assert_eq!(cursor_of(format!("-{n}").as_bytes()), Some(n.wrapping_neg()));
            let decimal = bytes.strip_prefix(b"-").or(bytes.strip_prefix(b"+")).unwrap_or(&bytes);
            if cursor_of(&bytes).is_some() {
                proptest::prop_assert!(!decimal.is_empty() && decimal.iter().all(u8::is_ascii_digit));
            }
        }
    }
}
