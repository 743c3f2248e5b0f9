//! Telling the service manager how the service stands, by systemd's notification
//! protocol (sd_notify(3)): datagrams of newline-separated `VARIABLE=value` lines sent to
//! the AF_UNIX datagram socket that `NOTIFY_SOCKET` names (a path, or after `@` a name in
//! the abstract namespace). `READY=1` once the service runs, `RELOADING=1` and `READY=1`
//! around a reload, `STOPPING=1`, `STATUS=` a line for `systemctl status`, and
//! `WATCHDOG=1` while the dataplane goes on (see [`super::liveness`]).

use std::io;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// A connection to the service manager's notification socket.
#[derive(Debug)]
pub struct Notifier {
    socket: UnixDatagram,
    to: SocketAddr,
    watchdog: Option<Duration>,
}

impl Notifier {
    /// The manager's socket, when the process runs under one that asked for notifications
    /// (`NOTIFY_SOCKET` set); with how often it wants `WATCHDOG=1` (see [`ping_every`]).
    pub fn from_env() -> Option<io::Result<Notifier>> {
        let path = std::env::var_os("NOTIFY_SOCKET")?;
        let var = |name| std::env::var(name).ok();
        let watchdog = ping_every(
            var("WATCHDOG_USEC").as_deref(),
            var("WATCHDOG_PID").as_deref(),
            std::process::id(),
        );
        Some(Notifier::open(path.as_encoded_bytes(), watchdog))
    }

    /// A notifier sending to the socket `name` (as `NOTIFY_SOCKET` gives it).
    pub fn open(name: &[u8], watchdog: Option<Duration>) -> io::Result<Notifier> {
        let to = match name.strip_prefix(b"@") {
            Some(abstract_name) => {
                use std::os::linux::net::SocketAddrExt;
                SocketAddr::from_abstract_name(abstract_name)?
            }
            None => {
                use std::os::unix::ffi::OsStrExt;
                SocketAddr::from_pathname(std::ffi::OsStr::from_bytes(name))?
            }
        };
        Ok(Notifier {
            socket: UnixDatagram::unbound()?,
            to,
            watchdog,
        })
    }

    /// Sends `state`, one or more `VARIABLE=value` lines.
    pub fn send(&self, state: &str) -> io::Result<()> {
        self.socket
            .send_to_addr(state.as_bytes(), &self.to)
            .map(|_| ())
    }

    /// How often to send `WATCHDOG=1`, when the manager watches the service.
    pub fn watchdog(&self) -> Option<Duration> {
        self.watchdog
    }
}

/// How often to feed the manager's watchdog: half its timeout (`WATCHDOG_USEC`, in
/// microseconds), as sd_watchdog_enabled(3) advises; none when it set no timeout, or set
/// one for another process (`WATCHDOG_PID`, when given, is not `own`).
fn ping_every(usec: Option<&str>, pid: Option<&str>, own: u32) -> Option<Duration> {
    if pid.is_some_and(|p| p.parse() != Ok(own)) {
        return None;
    }
    let usec: u64 = usec?.parse().ok().filter(|&u| u > 0)?;
    Some(Duration::from_micros(usec) / 2)
}

/// A status line safe to send: `STATUS=` takes one line.
pub fn status(text: &str) -> String {
    format!("STATUS={}", text.replace('\n', " "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watchdog_is_fed_at_half_its_timeout_and_only_when_it_watches_this_process() {
        let half = Some(Duration::from_secs(15));
        assert_eq!(ping_every(Some("30000000"), None, 7), half);
        assert_eq!(ping_every(Some("30000000"), Some("7"), 7), half);
        assert_eq!(ping_every(Some("30000000"), Some("8"), 7), None);
        assert_eq!(ping_every(Some("30000000"), Some("x"), 7), None);
        assert_eq!(ping_every(None, Some("7"), 7), None);
        assert_eq!(ping_every(Some("0"), None, 7), None);
        assert_eq!(ping_every(Some("soon"), None, 7), None);
    }

    #[test]
    fn datagrams_reach_a_socket_by_path_and_by_abstract_name() {
        let dir = std::env::temp_dir().join(format!("dpuflow-notify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join("notify");
        let by_path = UnixDatagram::bind(&path).expect("bind");
        let name = format!("@dpuflow-notify-test-{}", std::process::id());
        let by_name = {
            use std::os::linux::net::SocketAddrExt;
            let addr = SocketAddr::from_abstract_name(&name.as_bytes()[1..]).expect("name");
            UnixDatagram::bind_addr(&addr).expect("bind abstract")
        };
        for (to, socket) in [
            (path.as_os_str().as_encoded_bytes(), &by_path),
            (name.as_bytes(), &by_name),
        ] {
            let n = Notifier::open(to, None).expect("open");
            n.send(&format!("READY=1\n{}", status("running\nfine")))
                .expect("send");
            let mut buf = [0; 64];
            let len = socket.recv(&mut buf).expect("receive");
            assert_eq!(&buf[..len], b"READY=1\nSTATUS=running fine");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
