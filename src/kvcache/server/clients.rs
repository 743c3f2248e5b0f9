//! The connections a service serves, as `CLIENT LIST`, `CLIENT INFO` and `CLIENT KILL`
//! see them: each registered while its thread serves it, with what Redis 7 lists of a
//! client that means something here (its id, addresses, name, age, idle time, last
//! command, protocol, buffers, and the library it named with `CLIENT SETINFO`).
//!
//! A request updates its connection's entry with a few relaxed stores; the registry is
//! locked only when a connection comes or goes and when it is listed.

use super::catalog::SUBCOMMANDS;
use super::SERVED;
use crate::kvcache::resp::Proto;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

/// What a connection's name (`CLIENT SETNAME`, `HELLO … SETNAME`) may hold: printable
/// ASCII without spaces, so that `CLIENT LIST` splits on spaces (Redis's rule).
pub(super) fn valid_attribute(name: &[u8]) -> bool {
    name.iter().all(|b| (b'!'..=b'~').contains(b))
}

/// Redis's error for a name that breaks [`valid_attribute`].
pub(super) const BAD_NAME: &str =
    "ERR Client names cannot contain spaces, newlines or special characters.";

/// The attributes `CLIENT SETINFO` sets.
#[derive(Debug, Clone, Copy)]
pub(super) enum Attribute {
    Name,
    LibName,
    LibVer,
}

/// One connection as listed.
#[derive(Debug)]
pub struct ClientInfo {
    pub id: u64,
    pub addr: SocketAddr,
    pub laddr: SocketAddr,
    /// Its socket's descriptor (`fd=`); -1 for none.
    pub fd: i32,
    connected: Instant,
    /// Its name, and the client library's name and version it gave.
    attributes: Mutex<[Vec<u8>; 3]>,
    /// Milliseconds after `connected` of its last request.
    active_ms: AtomicU64,
    /// Its last command: its place in [`SERVED`] plus one, or for a subcommand its place
    /// in [`SUBCOMMANDS`] plus one after those (0: none yet).
    last_command: AtomicUsize,
    /// 2 or 3.
    resp: AtomicU8,
    /// Bytes its read buffer holds room for, of them the bytes of requests read and not
    /// yet served, and the room of its reply buffer: as they were when it last waited
    /// for requests.
    read_buffer: AtomicU64,
    pending: AtomicU64,
    reply_buffer: AtomicU64,
    /// `CLIENT KILL` chose it: its thread closes it after the reply it is writing.
    killed: AtomicBool,
}

impl ClientInfo {
    /// The request served now was a `command` (one of [`SERVED`]).
    pub fn served(&self, command: &str) {
        if let Ok(i) = SERVED.binary_search(&command) {
            self.last_command.store(i + 1, Relaxed);
        }
        self.touch();
    }

    /// The request served now is the subcommand in place `i` of [`SUBCOMMANDS`].
    pub fn serving_subcommand(&self, i: usize) {
        self.last_command.store(SERVED.len() + i + 1, Relaxed);
    }

    /// The connection was active now.
    pub fn touch(&self) {
        let ms = u64::try_from(self.connected.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.active_ms.store(ms, Relaxed);
    }

    pub fn set_resp(&self, proto: Proto) {
        self.resp.store(proto.version(), Relaxed);
    }

    /// Its buffers as it waits for requests: `read` bytes of room for them, `pending` of
    /// which hold what has arrived of the next; `reply` bytes of room for replies.
    pub fn set_buffers(&self, read: usize, pending: usize, reply: usize) {
        self.read_buffer.store(read as u64, Relaxed);
        self.pending.store(pending as u64, Relaxed);
        self.reply_buffer.store(reply as u64, Relaxed);
    }

    /// The room its read and reply buffers hold, bytes.
    pub fn buffers(&self) -> (u64, u64) {
        (
            self.read_buffer.load(Relaxed),
            self.reply_buffer.load(Relaxed),
        )
    }

    pub(super) fn set(&self, attribute: Attribute, value: &[u8]) {
        let mut a = self
            .attributes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        a[attribute as usize] = value.to_vec();
    }

    /// Its name; empty for none.
    pub fn name(&self) -> Vec<u8> {
        self.attributes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)[Attribute::Name as usize]
            .clone()
    }

    pub fn kill(&self) {
        self.killed.store(true, Relaxed);
    }

    pub fn is_killed(&self) -> bool {
        self.killed.load(Relaxed)
    }

    /// Its line of `CLIENT LIST` (without the newline), with Redis 7's fields in Redis's
    /// order. What the service does not have reads as Redis gives it for a client that
    /// does not use it: no subscriptions, no transaction (`multi=-1`), no tracking
    /// (`redir=-1`), `flags=N`, `db=0`, `user=default`; replies are written before the
    /// connection reads again, so none wait in an output buffer (`obl`, `oll`, `omem`).
    pub fn line(&self) -> String {
        let attributes = self
            .attributes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let [name, lib_name, lib_ver] = attributes.each_ref().map(|a| String::from_utf8_lossy(a));
        let age = self.connected.elapsed();
        let idle = age
            .as_millis()
            .saturating_sub(u128::from(self.active_ms.load(Relaxed)));
        let command = match self.last_command.load(Relaxed) {
            0 => "NULL",
            i if i <= SERVED.len() => SERVED[i - 1],
            i => SUBCOMMANDS[i - 1 - SERVED.len()].name,
        };
        let read = self.read_buffer.load(Relaxed);
        let pending = self.pending.load(Relaxed);
        let reply = self.reply_buffer.load(Relaxed);
        let mut line = String::with_capacity(320);
        let _ = write!(
            line,
            "id={} addr={} laddr={} fd={} name={name} age={} idle={} flags={} db=0 sub=0 psub=0 \
             ssub=0 multi=-1 qbuf={pending} qbuf-free={} argv-mem=0 multi-mem=0 rbs={read} \
             rbp={read} obl=0 oll=0 omem=0 tot-mem={} events=r cmd={command} user=default \
             redir=-1 resp={} lib-name={lib_name} lib-ver={lib_ver}",
            self.id,
            self.addr,
            self.laddr,
            self.fd,
            age.as_secs(),
            idle / 1000,
            // Redis's flags: `A` to be closed as soon as possible, `N` none.
            if self.is_killed() { "A" } else { "N" },
            read.saturating_sub(pending),
            read + reply,
            self.resp.load(Relaxed),
        );
        line
    }
}

/// The connections being served, by id.
#[derive(Debug, Default)]
pub struct Clients {
    last_id: AtomicU64,
    live: Mutex<BTreeMap<u64, Arc<ClientInfo>>>,
}

impl Clients {
    /// Lists a new connection, with the next id (ids are never reused).
    pub fn register(&self, addr: SocketAddr, laddr: SocketAddr, fd: i32) -> Arc<ClientInfo> {
        let info = Arc::new(ClientInfo {
            id: self.last_id.fetch_add(1, Relaxed) + 1,
            addr,
            laddr,
            fd,
            connected: Instant::now(),
            attributes: Mutex::default(),
            active_ms: AtomicU64::new(0),
            last_command: AtomicUsize::new(0),
            resp: AtomicU8::new(Proto::Resp2.version()),
            read_buffer: AtomicU64::new(0),
            pending: AtomicU64::new(0),
            reply_buffer: AtomicU64::new(0),
            killed: AtomicBool::new(false),
        });
        self.lock().insert(info.id, Arc::clone(&info));
        info
    }

    pub fn unregister(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// The connections now, by id.
    pub fn all(&self) -> Vec<Arc<ClientInfo>> {
        self.lock().values().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<ClientInfo>>> {
        self.live.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Which connections `CLIENT KILL` (its filter form) ends: all the filters given hold.
#[derive(Debug, Default)]
pub(super) struct KillFilter {
    pub id: Option<u64>,
    pub addr: Option<Vec<u8>>,
    pub laddr: Option<Vec<u8>>,
    /// `TYPE` named a kind of client the service never has (master, replica, pubsub).
    pub none: bool,
    /// `SKIPME no`: the connection asking may be among them.
    pub me_too: bool,
}

impl KillFilter {
    /// Reads `CLIENT KILL`'s filters as Redis 7.0 does, or its error.
    pub fn of(args: &[&[u8]]) -> Result<KillFilter, String> {
        let mut f = KillFilter::default();
        // In turn, as Redis reads them: an error in a filter comes before a last word
        // without its value.
        for pair in args.chunks(2) {
            let [key, value] = pair else {
                return Err("ERR syntax error".into());
            };
            let (key, value) = (key.to_ascii_lowercase(), *value);
            match key.as_slice() {
                b"id" => {
                    let id = super::commands::integer(value).filter(|&n| n > 0);
                    f.id = Some(id.ok_or("ERR client-id should be greater than 0")? as u64);
                }
                b"type" => f.none |= !normal_type(value)?,
                b"user" if value == b"default" => {}
                b"user" => {
                    let user = String::from_utf8_lossy(value);
                    return Err(format!("ERR No such user '{user}'"));
                }
                b"addr" => f.addr = Some(value.to_vec()),
                b"laddr" => f.laddr = Some(value.to_vec()),
                b"skipme" if value.eq_ignore_ascii_case(b"yes") => f.me_too = false,
                b"skipme" if value.eq_ignore_ascii_case(b"no") => f.me_too = true,
                _ => return Err("ERR syntax error".into()),
            }
        }
        Ok(f)
    }

    /// Whether it chooses `c`, asked by the connection `me`.
    pub fn chooses(&self, c: &ClientInfo, me: u64) -> bool {
        let same = |want: &Option<Vec<u8>>, have: SocketAddr| {
            want.as_ref()
                .is_none_or(|w| *w == have.to_string().as_bytes())
        };
        // One killed already is on its way out (its thread closes it within a socket
        // timeout): it is not chosen again.
        !self.none
            && !c.is_killed()
            && (self.me_too || c.id != me)
            && self.id.is_none_or(|id| id == c.id)
            && same(&self.addr, c.addr)
            && same(&self.laddr, c.laddr)
    }
}

/// Whether `CLIENT LIST TYPE` or `CLIENT KILL TYPE` names normal clients (`true`) or
/// another kind Redis has (`false`: none here), or Redis's error.
pub(super) fn normal_type(kind: &[u8]) -> Result<bool, String> {
    match kind.to_ascii_lowercase().as_slice() {
        b"normal" => Ok(true),
        b"master" | b"replica" | b"slave" | b"pubsub" => Ok(false),
        _ => Err(format!(
            "ERR Unknown client type '{}'",
            String::from_utf8_lossy(kind)
        )),
    }
}

/// A connection from 10.0.0.7:4000 to 10.0.0.2:6379, for tests of what is made of one.
#[cfg(test)]
pub(super) fn a_host() -> Arc<ClientInfo> {
    let from = "10.0.0.7:4000".parse().expect("address");
    Clients::default().register(from, "10.0.0.2:6379".parse().expect("address"), 5)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_line_lists_what_the_connection_did() {
        let clients = Clients::default();
        let c = clients.register(addr("127.0.0.1:5000"), addr("127.0.0.1:6379"), 9);
        let other = clients.register(addr("127.0.0.1:5001"), addr("127.0.0.1:6379"), 10);
        assert_eq!((c.id, other.id), (1, 2));
        c.set(Attribute::Name, b"prefill-7");
        c.set(Attribute::LibName, b"redis-py");
        c.served("get");
        c.set_resp(Proto::Resp3);
        c.set_buffers(65536, 10, 1024);
        let line = c.line();
        assert!(
            line.starts_with("id=1 addr=127.0.0.1:5000 laddr=127.0.0.1:6379 fd=9 name=prefill-7 age=0 idle=0 flags=N db=0"),
            "{line}"
        );
        assert!(
            line.ends_with(
                "qbuf=10 qbuf-free=65526 argv-mem=0 multi-mem=0 rbs=65536 rbp=65536 obl=0 oll=0 \
                 omem=0 tot-mem=66560 events=r cmd=get user=default redir=-1 resp=3 \
                 lib-name=redis-py lib-ver="
            ),
            "{line}"
        );
        assert!(other.line().contains(" cmd=NULL "));
        clients.unregister(1);
        assert_eq!(clients.all().len(), 1);
    }

    #[test]
    fn kill_filters_read_as_redis_reads_them() {
        let f = KillFilter::of(&[b"ID", b"2", b"skipme", b"NO"]).unwrap();
        assert_eq!((f.id, f.me_too), (Some(2), true));
        let err = |args: &[&[u8]]| KillFilter::of(args).unwrap_err();
        assert_eq!(
            err(&[b"id", b"0"]),
            "ERR client-id should be greater than 0"
        );
        assert_eq!(err(&[b"type", b"foo"]), "ERR Unknown client type 'foo'");
        assert_eq!(err(&[b"user", b"bob"]), "ERR No such user 'bob'");
        assert_eq!(err(&[b"skipme", b"maybe"]), "ERR syntax error");
        assert_eq!(err(&[b"maxage", b"1"]), "ERR syntax error");
        assert_eq!(err(&[b"id"]), "ERR syntax error");
        assert_eq!(
            err(&[b"id", b"x", b"type"]),
            "ERR client-id should be greater than 0"
        );
        let clients = Clients::default();
        let a = clients.register(addr("10.0.0.1:5000"), addr("10.0.0.2:6379"), 9);
        let by_addr = KillFilter::of(&[b"addr", b"10.0.0.1:5000"]).unwrap();
        assert!(by_addr.chooses(&a, 7) && !by_addr.chooses(&a, a.id));
        a.kill();
        assert!(!by_addr.chooses(&a, 7) && a.line().contains(" flags=A "));
        assert!(!KillFilter::of(&[b"type", b"pubsub"])
            .unwrap()
            .chooses(&a, 7));
        assert!(!KillFilter::of(&[b"laddr", b"10.0.0.2:1"])
            .unwrap()
            .chooses(&a, 7));
    }

    #[test]
    fn names_are_printable_without_spaces() {
        assert!(valid_attribute(b"worker-3") && valid_attribute(b""));
        assert!(!valid_attribute(b"a b") && !valid_attribute(b"a\nb") && !valid_attribute(b"\xff"));
    }
}
