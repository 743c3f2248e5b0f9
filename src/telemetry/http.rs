//! A minimal HTTP/1.1 endpoint on std sockets: `GET /metrics`, `/healthz`, `/readyz`. One
//! request a connection, answered and closed, each connection in a thread of its own (a
//! client that connects and sends nothing must not hold up the next scrape or probe);
//! enough for Prometheus and probes, no framework. Over TLS where configured (HTTPS, as
//! Prometheus's `scheme: https` scrapes), then only over TLS; `/metrics` to the users the
//! handler admits (basic auth, where configured; the probes' paths stay open).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Largest request head read.
const MAX_REQUEST: usize = 8192;
/// Connections answered at once; more are closed unanswered.
const MAX_CONNECTIONS: usize = 16;

/// How long a client may take over each half of its connection, in all: a timeout on each
/// read or write alone would let one that sends its request (or reads the answer) a byte at
/// a time hold a connection for hours, and sixteen of them the endpoint, and a stop wait
/// for them.
#[derive(Debug, Clone, Copy)]
struct Deadlines {
    /// To send the request head (a stalled client delays a stop by as much).
    request: Duration,
    /// To take the whole answer (Prometheus gives a scrape 10 s by default).
    answer: Duration,
}

const DEADLINES: Deadlines = Deadlines {
    request: Duration::from_secs(2),
    answer: Duration::from_secs(10),
};

/// What the endpoint counts of its own connections, for its metrics.
#[derive(Debug, Default)]
pub struct Counts {
    /// Connections closed unanswered: as many as the endpoint answers at once (16) were
    /// being answered.
    pub refused: AtomicU64,
    /// Connections ended by a TLS error: a failed handshake (a client that does not trust
    /// the certificate, or is not trusted, or speaks plain HTTP) or a bad record.
    pub tls_failures: AtomicU64,
    /// Requests for `/metrics` refused for want of a user's name and password.
    pub auth_failures: AtomicU64,
    /// When a refused client was last logged.
    warned: Mutex<super::WarnThrottle>,
}

impl Counts {
    /// Counts a client refused in `counter` and logs it, at most once every ten seconds
    /// (a scraper refused once is refused at every scrape).
    fn refuse(&self, counter: &AtomicU64, client: Option<SocketAddr>, why: &str) {
        counter.fetch_add(1, Ordering::Relaxed);
        if (self.warned.lock().unwrap_or_else(PoisonError::into_inner)).ready() {
            let client = client.map_or_else(|| "unknown".to_owned(), |c| c.to_string());
            tracing::warn!(%client, why, "metrics endpoint refused a client (logged at most every 10 s; the dpuflow_metrics_endpoint_*_failures_total counters count each)");
        }
    }
}

/// What the endpoint serves.
pub trait Handler: Sync {
    /// The body of `/metrics`.
    fn metrics(&self) -> String;
    /// Whether `/readyz` says ready.
    fn ready(&self) -> bool;
    /// Why `/healthz` fails, if it does.
    fn unhealthy(&self) -> Option<String>;
    /// Where the endpoint counts its connections.
    fn counts(&self) -> &Counts;
    /// Whether a request with this `Authorization` header (its value) may read `/metrics`.
    fn admits(&self, authorization: Option<&str>) -> bool;
}

/// Serves until `stop` is set (checked every 50 ms), then waits for the connections being
/// answered; over TLS with `tls`. A failed `accept` (a connection reset before it was
/// taken, descriptors exhausted) is logged and served past, never the end of the endpoint.
pub fn serve(
    listener: &TcpListener,
    stop: &AtomicBool,
    handler: &dyn Handler,
    tls: Option<&crate::tls::Rotating>,
) -> std::io::Result<()> {
    let mut acceptor = crate::sys::Acceptor::new(listener)?;
    let open = AtomicUsize::new(0);
    let mut throttle = super::WarnThrottle::default();
    std::thread::scope(|s| {
        while !stop.load(Ordering::Relaxed) {
            match acceptor.accept(Duration::from_millis(50)) {
                Ok(None) => {}
                Ok(Some((stream, _))) if open.load(Ordering::Relaxed) >= MAX_CONNECTIONS => {
                    tracing::debug!("http connection refused: too many open");
                    handler.counts().refused.fetch_add(1, Ordering::Relaxed);
                    drop(stream);
                }
                Ok(Some((stream, _))) => {
                    open.fetch_add(1, Ordering::Relaxed);
                    let open = &open;
                    let tls = tls.map(crate::tls::Rotating::current);
                    s.spawn(move || {
                        if let Err(e) = connection(stream, handler, DEADLINES, tls) {
                            tracing::debug!(error = %e, "http request failed");
                        }
                        open.fetch_sub(1, Ordering::Relaxed);
                    });
                }
                Err(e) => {
                    if throttle.ready() {
                        tracing::warn!(error = %e, "metrics endpoint: accept failed");
                    }
                    std::thread::sleep(Duration::from_millis(50))
                }
            }
        }
    });
    Ok(())
}

/// Answers one connection, plain or over TLS (whose handshake counts in the time to send
/// the request).
fn connection(
    stream: TcpStream,
    handler: &dyn Handler,
    limits: Deadlines,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<()> {
    let client = stream.peer_addr().ok();
    let mut timed = Timed {
        stream,
        until: Instant::now() + limits.request,
    };
    match tls {
        None => answer(&mut timed, client, handler, limits),
        Some(config) => {
            let tls = rustls::ServerConnection::new(config).map_err(io_error)?;
            let mut stream = rustls::StreamOwned::new(tls, timed);
            let answered = answer(&mut stream, client, handler, limits).and_then(|()| {
                // Said before closing, so the client can tell the end of the answer from a
                // cut.
                stream.conn.send_close_notify();
                stream.flush()
            });
            // rustls reports what breaks TLS as invalid data; a client that connects and
            // leaves (a TCP probe) ends it otherwise.
            if let Err(e) = &answered {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    let counts = handler.counts();
                    counts.refuse(&counts.tls_failures, client, &format!("TLS: {e}"));
                }
            }
            answered
        }
    }
}

/// A TLS failure as the I/O error of a peer that sent what TLS does not allow.
fn io_error(e: rustls::Error) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e)
}

/// A connection whose deadline can be moved: the plain socket, or TLS over it.
trait Deadlined: Read + Write {
    fn set_deadline(&mut self, until: Instant);
}

impl Deadlined for Timed {
    fn set_deadline(&mut self, until: Instant) {
        self.until = until;
    }
}

impl Deadlined for rustls::StreamOwned<rustls::ServerConnection, Timed> {
    fn set_deadline(&mut self, until: Instant) {
        self.sock.until = until;
    }
}

/// Reads one request (of `client`) and writes its answer.
fn answer(
    stream: &mut impl Deadlined,
    client: Option<SocketAddr>,
    handler: &dyn Handler,
    limits: Deadlines,
) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk)?;
        if n == 0 || buf.len() + n > MAX_REQUEST {
            return respond(
                stream,
                false,
                "400 Bad Request",
                "text/plain",
                "bad request\n",
            );
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let authorization = head.lines().skip(1).find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim()
            .eq_ignore_ascii_case("authorization")
            .then_some(value.trim())
    });
    let mut parts = head.lines().next().unwrap_or_default().split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = target.split('?').next().unwrap_or_default();
    stream.set_deadline(Instant::now() + limits.answer);
    if method != "GET" && method != "HEAD" {
        return respond(
            stream,
            false,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
        );
    }
    let head_only = method == "HEAD";
    match path {
        "/metrics" if !handler.admits(authorization) => {
            let counts = handler.counts();
            let why = match authorization {
                Some(_) => "basic auth: not a user's name and password",
                None => "basic auth: no credentials",
            };
            counts.refuse(&counts.auth_failures, client, why);
            respond_with(
                stream,
                head_only,
                "401 Unauthorized",
                // RFC 7617 §2.
                "WWW-Authenticate: Basic realm=\"dpuflow\", charset=\"UTF-8\"\r\n",
                "text/plain",
                "a user's name and password, please\n",
            )
        }
        "/metrics" => respond(
            stream,
            head_only,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &handler.metrics(),
        ),
        "/healthz" => match handler.unhealthy() {
            None => respond(stream, head_only, "200 OK", "text/plain", "ok\n"),
            Some(why) => respond(
                stream,
                head_only,
                "503 Service Unavailable",
                "text/plain",
                &format!("{why}\n"),
            ),
        },
        "/readyz" if handler.ready() => {
            respond(stream, head_only, "200 OK", "text/plain", "ready\n")
        }
        "/readyz" => respond(
            stream,
            head_only,
            "503 Service Unavailable",
            "text/plain",
            "not ready\n",
        ),
        _ => respond(
            stream,
            head_only,
            "404 Not Found",
            "text/plain",
            "not found: try /metrics, /healthz, /readyz\n",
        ),
    }
}

/// Writes the answer; to a `HEAD`, the headers only (RFC 9110 §9.3.2).
fn respond(
    stream: &mut impl Write,
    head_only: bool,
    status: &str,
    kind: &str,
    body: &str,
) -> std::io::Result<()> {
    respond_with(stream, head_only, status, "", kind, body)
}

/// [`respond`] with more header lines (each ending in CRLF).
fn respond_with(
    stream: &mut impl Write,
    head_only: bool,
    status: &str,
    headers: &str,
    kind: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\n{headers}Content-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

/// A connection whose reads and writes fail with [`std::io::ErrorKind::TimedOut`] once
/// `until` has passed, each waiting no longer than what is left.
struct Timed {
    stream: TcpStream,
    until: Instant,
}

impl Timed {
    /// What is left until the deadline; an error once none is (a zero timeout would mean
    /// none at all to the socket).
    fn left(&self) -> std::io::Result<Duration> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(left)
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            self.stream.set_read_timeout(Some(self.left()?))?;
            match self.stream.read(buf) {
                // A read with a timeout ends so when the process is stopped and continued
                // (signal(7)); the deadline still holds.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                r => return r,
            }
        }
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    /// Serves a body of its number of bytes, to requests with the `Authorization` header
    /// it wants, if any.
    struct Body(usize, Counts, Option<&'static str>);

    impl Body {
        fn of(len: usize) -> Body {
            Body(len, Counts::default(), None)
        }
    }

    impl Handler for Body {
        fn metrics(&self) -> String {
            "x".repeat(self.0)
        }

        fn ready(&self) -> bool {
            true
        }

        fn unhealthy(&self) -> Option<String> {
            None
        }

        fn counts(&self) -> &Counts {
            &self.1
        }

        fn admits(&self, authorization: Option<&str>) -> bool {
            self.2.is_none_or(|wanted| authorization == Some(wanted))
        }
    }

    const SHORT: Deadlines = Deadlines {
        request: Duration::from_millis(300),
        answer: Duration::from_millis(300),
    };

    /// A connected pair on loopback: the client's end, then the server's.
    fn connected() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("address")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        (client, server)
    }

    fn timed_out(r: &std::io::Result<()>) -> bool {
        matches!(r, Err(e) if matches!(e.kind(), ErrorKind::TimedOut | ErrorKind::WouldBlock))
    }

    /// A request sent a byte at a time, each well within a single read's timeout, is cut
    /// off at the request's deadline (timing out each read alone, it held the connection
    /// for as long as the client kept trickling).
    #[test]
    fn a_request_trickled_byte_by_byte_is_cut_off() {
        let (mut client, server) = connected();
        let trickle = std::thread::spawn(move || {
            // Never the blank line that ends a head; ten seconds of it at most.
            for _ in 0..200 {
                if client.write_all(b"G").is_err() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            false
        });
        let r = connection(server, &Body::of(10), SHORT, None);
        assert!(timed_out(&r), "{r:?}");
        assert!(
            trickle.join().expect("trickle"),
            "the connection stayed open"
        );
    }

    /// A client that asks and never reads is given up once the answer's time is spent,
    /// not waited for (with no write deadline its thread, and a stop, waited forever).
    #[test]
    fn an_answer_never_read_is_given_up_at_its_deadline() {
        let (mut client, server) = connected();
        client
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("request");
        // Larger than any socket buffers between the two ends.
        let r = connection(server, &Body::of(64 << 20), SHORT, None);
        assert!(timed_out(&r), "{r:?}");
    }

    /// Within its deadlines a request is answered whole.
    #[test]
    fn a_prompt_client_gets_the_whole_answer() {
        let (mut client, server) = connected();
        client
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("request");
        let reader = std::thread::spawn(move || {
            let mut answer = Vec::new();
            client.read_to_end(&mut answer).expect("read");
            answer
        });
        connection(server, &Body::of(1 << 20), DEADLINES, None).expect("answered");
        let got = reader.join().expect("reader");
        assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"));
        assert!(got.ends_with(&[b'x'; 1 << 20]));
    }

    /// Past [`MAX_CONNECTIONS`] being answered, a connection is closed unanswered at once,
    /// and counted.
    #[test]
    fn connections_past_the_limit_are_closed_and_counted() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let stop = AtomicBool::new(false);
        let body = Body::of(10);
        std::thread::scope(|s| {
            let server = s.spawn(|| serve(&listener, &stop, &body, None));
            // Connections that send nothing hold their places for the request's deadline.
            let idle: Vec<TcpStream> = (0..MAX_CONNECTIONS)
                .map(|_| TcpStream::connect(addr).expect("connect"))
                .collect();
            let mut extra = TcpStream::connect(addr).expect("connect");
            extra
                .set_read_timeout(Some(Duration::from_secs(1)))
                .expect("timeout");
            assert_eq!(extra.read(&mut [0; 1]).expect("closed"), 0);
            assert_eq!(body.1.refused.load(Ordering::Relaxed), 1);
            stop.store(true, Ordering::Relaxed);
            drop(idle);
            server.join().expect("server").expect("served");
        });
    }

    /// The answer to one request sent whole on a connection of its own.
    fn asked(body: &Body, request: &str) -> String {
        let (mut client, server) = connected();
        client.write_all(request.as_bytes()).expect("request");
        connection(server, body, DEADLINES, None).expect("answered");
        let mut answer = String::new();
        client.read_to_string(&mut answer).expect("read");
        answer
    }

    /// Where the handler wants a user's credentials, `/metrics` without them (or with
    /// others) is answered 401 with the scheme to use, and counted; the probes' paths
    /// need none.
    #[test]
    fn metrics_wait_for_credentials_the_probes_do_not() {
        let body = Body(3, Counts::default(), Some("Basic dTpw"));
        let without = asked(&body, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(
            without.starts_with("HTTP/1.1 401 Unauthorized\r\n"),
            "{without}"
        );
        assert!(without.contains("\r\nWWW-Authenticate: Basic realm=\"dpuflow\""));
        let wrong = asked(
            &body,
            "GET /metrics HTTP/1.1\r\nAuthorization: Basic eDp5\r\n\r\n",
        );
        assert!(wrong.starts_with("HTTP/1.1 401 "), "{wrong}");
        assert_eq!(body.1.auth_failures.load(Ordering::Relaxed), 2);
        let right = asked(
            &body,
            "GET /metrics HTTP/1.1\r\nHost: x\r\nauthorization:  Basic dTpw \r\n\r\n",
        );
        assert!(
            right.starts_with("HTTP/1.1 200 OK\r\n") && right.ends_with("xxx"),
            "{right}"
        );
        let probe = asked(&body, "GET /healthz HTTP/1.1\r\n\r\n");
        assert!(probe.starts_with("HTTP/1.1 200 OK\r\n"), "{probe}");
        assert_eq!(body.1.auth_failures.load(Ordering::Relaxed), 2);
    }
}
