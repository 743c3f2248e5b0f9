//! A minimal HTTP/1.1 endpoint on std sockets: `GET /metrics`, `/healthz`, `/readyz`. One
//! request a connection, answered and closed; enough for Prometheus and probes, no
//! framework.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Largest request head read.
const MAX_REQUEST: usize = 8192;

/// What the endpoint serves.
pub trait Handler {
    /// The body of `/metrics`.
    fn metrics(&self) -> String;
    /// Whether `/readyz` says ready.
    fn ready(&self) -> bool;
}

/// Serves until `stop` is set (checked every 50 ms).
pub fn serve(
    listener: &TcpListener,
    stop: &AtomicBool,
    handler: &dyn Handler,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = answer(stream, handler) {
                    tracing::debug!(error = %e, "http request failed");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn answer(mut stream: TcpStream, handler: &dyn Handler) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut chunk)?;
        if n == 0 || buf.len() + n > MAX_REQUEST {
            return respond(
                &mut stream,
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
            "405 Method Not Allowed",
            "text/plain",
            "only GET\n",
        );
    }
    match path {
        "/metrics" => respond(
            &mut stream,
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            &handler.metrics(),
        ),
        "/healthz" => respond(&mut stream, "200 OK", "text/plain", "ok\n"),
        "/readyz" if handler.ready() => respond(&mut stream, "200 OK", "text/plain", "ready\n"),
        "/readyz" => respond(
            &mut stream,
            "503 Service Unavailable",
            "text/plain",
            "not ready\n",
        ),
        _ => respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            "not found: try /metrics, /healthz, /readyz\n",
        ),
    }
}

fn respond(stream: &mut TcpStream, status: &str, kind: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    stream.flush()
}
