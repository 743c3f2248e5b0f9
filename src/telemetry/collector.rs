//! The way to the IPFIX collector: a connected UDP socket and, for a collector given by
//! name, a thread that resolves the name again now and then, so the export follows a
//! collector that moves (a DNS failover, a Kubernetes service whose pod was rescheduled);
//! and the pace messages go at, which a collector's receive buffer must absorb.

use crate::ir::HostPort;
use crate::telemetry::WarnThrottle;
use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

/// How often a collector's name is resolved again: a service name's usual DNS time to live
/// (Kubernetes' CoreDNS gives 30 s).
pub const RESOLVE_EVERY: Duration = Duration::from_secs(30);

/// Where to export: the collector's address, and the name it was given by, if any.
#[derive(Debug, Clone)]
pub struct Destination {
    pub address: SocketAddr,
    pub name: Option<HostPort>,
}

impl Destination {
    /// The collector as it was given: its name and port, or its address.
    pub fn label(&self) -> String {
        match &self.name {
            Some(name) => name.to_string(),
            None => self.address.to_string(),
        }
    }
}

/// The socket the export sends on, connected to where the collector is now.
#[derive(Debug)]
pub struct Collector {
    socket: UdpSocket,
    address: SocketAddr,
    /// For a collector given by name: each address the name resolved to since the last
    /// look, and the resolver's stop signal (it stops when this is dropped).
    follow: Option<(Receiver<SocketAddr>, Sender<()>)>,
}

impl Collector {
    /// A socket connected to the destination; its name, if it has one, resolved again every
    /// [`RESOLVE_EVERY`] by the system resolver.
    pub fn open(to: &Destination) -> io::Result<Collector> {
        match &to.name {
            None => Collector::connect(to.address),
            Some(name) => {
                let name = name.clone();
                Collector::following(to.address, RESOLVE_EVERY, move || name.resolve())
            }
        }
    }

    /// A socket connected to `address`, which stays.
    pub fn connect(address: SocketAddr) -> io::Result<Collector> {
        Ok(Collector {
            socket: socket_to(address)?,
            address,
            follow: None,
        })
    }

    /// A socket connected to `address`, where the collector is now, and a thread that
    /// calls `resolve` every `every` to learn where it is then: in a thread of its own, so a
    /// slow DNS server never holds up the export.
    pub fn following(
        address: SocketAddr,
        every: Duration,
        resolve: impl FnMut() -> io::Result<SocketAddr> + Send + 'static,
    ) -> io::Result<Collector> {
        let socket = socket_to(address)?;
        let (addresses, found) = unbounded();
        let (stop, stopped) = crossbeam_channel::bounded(0);
        std::thread::Builder::new()
            .name("ipfix-resolve".into())
            .spawn(move || resolve_now_and_then(every, resolve, &addresses, &stopped))?;
        Ok(Collector {
            socket,
            address,
            follow: Some((found, stop)),
        })
    }

    /// Where the collector is now.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Whether addresses of either family may come (a name may resolve to either).
    pub fn follows(&self) -> bool {
        self.follow.is_some()
    }

    /// Moves to the collector's latest address if its name resolved elsewhere since the
    /// last call: true when it did (a new collector has seen no templates). Where the new
    /// address cannot be reached, the export stays where it was until the next resolution.
    pub fn moved(&mut self) -> bool {
        let Some(latest) = self.follow.as_ref().and_then(|(a, _)| a.try_iter().last()) else {
            return false;
        };
        if latest == self.address {
            return false;
        }
        match socket_to(latest) {
            Ok(socket) => {
                tracing::info!(from = %self.address, to = %latest, "IPFIX collector moved");
                self.socket = socket;
                self.address = latest;
                true
            }
            Err(e) => {
                tracing::warn!(to = %latest, error = %e, "IPFIX collector moved, but cannot reach it there");
                false
            }
        }
    }

    /// Sends one message.
    pub fn send(&self, message: &[u8]) -> io::Result<usize> {
        self.socket.send(message)
    }
}

/// Messages sent back to back after a quiet spell: a burst that a collector's default
/// receive buffer (212,992 bytes on Linux, about 90 full-size datagrams) takes whole.
const BURST: u32 = 16;
/// The shortest wait worth sleeping for; closer messages go together (a sleep wakes
/// tens of microseconds late, so shorter ones would slow the pace below the rate).
const SHORTEST_WAIT: Duration = Duration::from_millis(1);

/// Spaces messages at a rate a second. UDP has no congestion control of its own (RFC
/// 7011 §10.3): the messages of a million expiring flows sent as fast as the socket
/// takes them overflow the collector's receive buffer, and what overflows is lost
/// unseen. Sans-IO: the caller passes the time and does the waiting.
#[derive(Debug)]
pub struct Pacer {
    /// Between two messages.
    interval: Duration,
    /// When the next message is due: one interval after the last, never earlier than
    /// [`BURST`] intervals before now (a quiet spell earns at most that burst).
    due: Option<Instant>,
}

impl Pacer {
    /// At most `per_second` messages a second (at least 1).
    pub fn new(per_second: u32) -> Pacer {
        Pacer {
            interval: Duration::from_secs(1) / per_second.max(1),
            due: None,
        }
    }

    /// How long to wait, from `now`, before sending the next message, which is then
    /// counted sent; zero when it may go now.
    pub fn wait(&mut self, now: Instant) -> Duration {
        let earliest = now.checked_sub(self.interval * BURST).unwrap_or(now);
        let due = self.due.map_or(earliest, |d| d.max(earliest));
        self.due = Some(due + self.interval);
        match due.saturating_duration_since(now) {
            wait if wait >= SHORTEST_WAIT => wait,
            _ => Duration::ZERO,
        }
    }
}

/// A UDP socket of the address's family, connected to it.
fn socket_to(address: SocketAddr) -> io::Result<UdpSocket> {
    let socket = UdpSocket::bind(if address.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    })?;
    socket.connect(address)?;
    Ok(socket)
}

/// Resolves every `every`, sending each address found, until `stop` is dropped (or
/// nobody takes the addresses). A failure keeps the export where it was, with a warning.
fn resolve_now_and_then(
    every: Duration,
    mut resolve: impl FnMut() -> io::Result<SocketAddr>,
    addresses: &Sender<SocketAddr>,
    stop: &Receiver<()>,
) {
    let mut warning = WarnThrottle::default();
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(every) {
        match resolve() {
            Ok(address) => {
                if addresses.send(address).is_err() {
                    return;
                }
            }
            Err(e) => {
                if warning.ready() {
                    tracing::warn!(error = %e, "cannot resolve the IPFIX collector again: exporting to its last address");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;

    fn listener() -> (UdpSocket, SocketAddr) {
        let s = UdpSocket::bind("127.0.0.1:0").expect("bind");
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        let a = s.local_addr().expect("address");
        (s, a)
    }

    fn received(s: &UdpSocket) -> Vec<u8> {
        let mut buf = [0u8; 64];
        let n = s.recv(&mut buf).expect("a message");
        buf[..n].to_vec()
    }

    /// Waits until `c` has moved (the resolver runs every millisecond).
    fn until_moved(c: &mut Collector) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !c.moved() {
            assert!(Instant::now() < deadline, "never moved");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn a_named_collector_is_followed_where_it_moves() {
        let ((old, a), (new, b)) = (listener(), listener());
        // The name resolves to `a`, then fails for a while, then resolves to `b`.
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let mut c = Collector::following(a, Duration::from_millis(1), move || {
            match counted.fetch_add(1, Ordering::Relaxed) {
                0..3 => Ok(a),
                3..6 => Err(io::Error::other("no answer")),
                _ => Ok(b),
            }
        })
        .expect("socket");
        c.send(b"one").expect("sent");
        assert_eq!(received(&old), b"one");
        until_moved(&mut c);
        assert!(calls.load(Ordering::Relaxed) > 6);
        assert_eq!(c.address(), b);
        c.send(b"two").expect("sent");
        assert_eq!(received(&new), b"two");
        // Still there: no move to report.
        std::thread::sleep(Duration::from_millis(20));
        assert!(!c.moved());
    }

    /// Messages go at the rate, a burst of [`BURST`] after a quiet spell and no more.
    #[test]
    fn messages_are_paced_with_a_bounded_burst() {
        let start = Instant::now();
        let mut pacer = Pacer::new(1000);
        // All sent at one instant: the burst goes at once, then each waits its turn.
        let waits: Vec<Duration> = (0..40).map(|_| pacer.wait(start)).collect();
        assert!(waits[..BURST as usize + 1].iter().all(|w| w.is_zero()));
        assert_eq!(waits[39], Duration::from_millis(39 - u64::from(BURST)));
        // Sent at the rate, none waits.
        let later = start + Duration::from_secs(1);
        let mut pacer = Pacer::new(1000);
        for i in 0..100 {
            assert!(pacer.wait(later + Duration::from_millis(i)).is_zero());
        }
        // A quiet second earns a burst again, not a second's worth.
        let quiet = later + Duration::from_secs(2);
        let waits: Vec<Duration> = (0..100).map(|_| pacer.wait(quiet)).collect();
        assert_eq!(
            waits.iter().filter(|w| w.is_zero()).count(),
            BURST as usize + 1
        );
        // Waits shorter than a sleep's precision are not waited: 10,000 a second go
        // ten at a time.
        let mut pacer = Pacer::new(10_000);
        let waits: Vec<Duration> = (0..40).map(|_| pacer.wait(later)).collect();
        assert_eq!(
            waits.iter().filter(|w| w.is_zero()).count(),
            BURST as usize + 10
        );
    }

    proptest::proptest! {
        /// Whatever the gaps between messages (mostly none: a backlog), a sender that waits
        /// as told never sends more in any span than the span's share at the rate, the
        /// burst and a millisecond's worth.
        #[test]
        fn no_span_exceeds_the_rate(
            rate in 1u32..100_000,
            gaps in proptest::collection::vec(
                proptest::prop_oneof![3 => proptest::strategy::Just(0u64), 1 => 0u64..3_000_000],
                1..300,
            ),
        ) {
            let mut pacer = Pacer::new(rate);
            let mut now = Instant::now();
            let mut sent = Vec::new();
            for gap in gaps {
                now += Duration::from_nanos(gap);
                now += pacer.wait(now);
                sent.push(now);
            }
            let interval = Duration::from_secs(1) / rate;
            let slack = u64::from(BURST) + 2 + (SHORTEST_WAIT.as_nanos() / interval.as_nanos()) as u64;
            for (i, first) in sent.iter().enumerate() {
                for (j, last) in sent.iter().enumerate().skip(i) {
                    let span = (*last - *first).as_nanos() / interval.as_nanos();
                    proptest::prop_assert!((j - i + 1) as u64 <= span as u64 + slack);
                }
            }
        }
    }

    #[test]
    fn an_address_stays_and_a_dropped_collector_stops_its_resolver() {
        let (_s, a) = listener();
        let mut fixed = Collector::connect(a).expect("socket");
        assert!(!fixed.follows() && !fixed.moved());

        // The resolver holds `alive`: when its thread ends, `ended` hears of it.
        let (alive, ended) = crossbeam_channel::bounded::<()>(0);
        let c = Collector::following(a, Duration::from_secs(3600), move || {
            let _ = &alive;
            Ok(a)
        })
        .expect("socket");
        assert!(c.follows());
        drop(c);
        assert_eq!(
            ended.recv_timeout(Duration::from_secs(5)),
            Err(RecvTimeoutError::Disconnected),
            "the resolver thread still runs"
        );
    }
}
