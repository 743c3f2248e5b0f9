//! A minimal HTTP/1.1 endpoint on std sockets: `GET /metrics`, `/healthz`, `/readyz`. One
//! request a connection, answered and closed, each connection in a thread of its own (a
//! client that connects and sends nothing must not hold up the next scrape or probe);
//! enough for Prometheus and probes, no framework.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Largest request head read.
const MAX_REQUEST: usize = 8192;
/// Connections answered at once; more are closed unanswered.
const MAX_CONNECTIONS: usize = 16;
/// How long a client may take to send its request (a stalled one delays shutdown by as
/// much).
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// What the endpoint serves.
pub trait Handler: Sync {
    /// The body of `/metrics`.
    fn metrics(&self) -> String;
    /// Whether `/readyz` says ready.
    fn ready(&self) -> bool;
}

/// Serves until `stop` is set (checked every 50 ms), then waits for the connections being
/// answered. A failed `accept` (a connection reset before it was taken, descriptors
/// exhausted) is logged and served past, never the end of the endpoint.
pub fn serve(
    listener: &TcpListener,
    stop: &AtomicBool,
    handler: &dyn Handler,
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
                    drop(stream);
                }
                Ok(Some((stream, _))) => {
                    open.fetch_add(1, Ordering::Relaxed);
                    let open = &open;
                    s.spawn(move || {
                        if let Err(e) = answer(stream, handler) {
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

fn answer(mut stream: TcpStream, handler: &dyn Handler) -> std::io::Result<()> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk)?;
        if n == 0 || buf.len() + n > MAX_REQUEST {
            return respond(
                &mut stream,
                false,
                "400 Bad Request",
                "text/plain",
                "bad request\n",
            );
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut parts = head.lines().next().unwrap_or_default().split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = target.split('?').next().unwrap_or_default();
    if method != "GET" && method != "HEAD" {
        return respond(
            &mut stream,
            false,
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
        );
    }
    let (head_only, stream) = (method == "HEAD", &mut stream);
    match path {
        "/metrics" => respond(
            stream,
            head_only,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &handler.metrics(),
        ),
        "/healthz" => respond(stream, head_only, "200 OK", "text/plain", "ok\n"),
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
    stream: &mut TcpStream,
    head_only: bool,
    status: &str,
    kind: &str,
    body: &str,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}
