//! The IPFIX export thread: sends the workers' flow records to the collectors, each
//! message to each (one stream, numbered alike for all: RFC 7011 §3.1's sequence counts
//! the records of the observation domain).

use super::{live_clock_to_wall, wall_clock_ns, Shared};
use crate::telemetry::collector::{Collector, Pacer};
use crate::telemetry::flows::FlowRecord;
use crate::telemetry::ipfix::Exporter;
use crate::telemetry::WarnThrottle;
use crossbeam_channel::{Receiver, Sender, TrySendError};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Hands `records` to the exporter if its queue has room; gives them back if not (and
/// drops them if the exporter is gone).
pub(super) fn queue(
    tx: &Sender<Vec<FlowRecord>>,
    records: Vec<FlowRecord>,
) -> Option<Vec<FlowRecord>> {
    match tx.try_send(records) {
        Err(TrySendError::Full(back)) => Some(back),
        Ok(()) | Err(TrySendError::Disconnected(_)) => None,
    }
}

/// Sends flow records as IPFIX messages to each collector until every worker is done,
/// counting messages sent and refused in `shared`; returns the records sent. Where a
/// collector moves, the templates go again before the next records.
pub(super) fn export(
    collectors: &mut [Collector],
    rx: &Receiver<Vec<FlowRecord>>,
    shared: &Shared,
) -> u64 {
    let Some(counts) = &shared.export else {
        return 0;
    };
    // Neither changes on a reload.
    let loaded = shared.loaded();
    let t = &loaded.program.telemetry;
    let ports = loaded
        .program
        .ports
        .iter()
        .map(|p| p.name.clone())
        .collect();
    let refresh = t.template_refresh.as_secs().max(1);
    // Each message, in its UDP and IP headers, fits the path MTU (a named collector's
    // may be IPv6 after a move).
    let headers = (collectors.iter())
        .map(|c| match c.address() {
            SocketAddr::V4(_) if !c.follows() => 20 + 8,
            _ => 40 + 8,
        })
        .max()
        .unwrap_or(20 + 8);
    let largest = usize::from(t.ipfix_mtu).saturating_sub(headers);
    let mut exporter =
        Exporter::new(t.observation_domain, largest, refresh, t.sampling).naming(ports);
    let mut sent = 0u64;
    // Failures since the last warning, and when that was: a collector that is down would
    // otherwise be reported for every message.
    let (mut unreported, mut warning) = (0u64, WarnThrottle::default());
    let mut pacer = Pacer::new(t.ipfix_rate);
    let mut send = |collectors: &[Collector], msg: &[u8]| {
        let wait = pacer.wait(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
            counts
                .paced_ns
                .fetch_add(wait.as_nanos() as u64, Ordering::Relaxed);
        }
        for (collector, counted) in collectors.iter().zip(&counts.collectors) {
            match collector.send(msg) {
                Ok(_) => counted.messages.fetch_add(1, Ordering::Relaxed),
                Err(e) => {
                    unreported += 1;
                    if warning.ready() {
                        tracing::warn!(collector = %counted.label, error = %e, messages = unreported, "IPFIX messages not sent");
                        unreported = 0;
                    }
                    counted.failed.fetch_add(1, Ordering::Relaxed)
                }
            };
        }
    };
    let now_s = || wall_clock_ns() / 1_000_000_000;
    // What the flow records miss (flows the caches had no room for) goes to the collector
    // too, when it has grown: at most once an active timeout, and at the end.
    let ignored = || {
        shared.snapshots.iter().fold((0, 0), |(p, b), s| {
            let f = s.lock().ok().and_then(|s| s.flows).unwrap_or_default();
            (p + f.full_packets, b + f.full_bytes)
        })
    };
    let (every, mut reported, mut reported_at) = (t.active_timeout, (0, 0), None::<Instant>);
    for mut records in rx.iter() {
        // Every collector asked (each moves its own socket); one that moved has seen no
        // templates.
        if collectors.iter_mut().fold(false, |any, c| c.moved() | any) {
            exporter.resend_templates();
        }
        if shared.live {
            let to_wall = live_clock_to_wall();
            for r in &mut records {
                r.first_ns = r.first_ns.saturating_add_signed(to_wall);
                r.last_ns = r.last_ns.saturating_add_signed(to_wall);
            }
        }
        exporter.messages(&records, now_s(), &mut |m| send(collectors, m));
        sent += records.len() as u64;
        let now = ignored();
        if now != reported && reported_at.is_none_or(|at| at.elapsed() >= every) {
            exporter.ignored(now.0, now.1, now_s(), &mut |m| send(collectors, m));
            (reported, reported_at) = (now, Some(Instant::now()));
        }
    }
    let now = ignored();
    if now != reported {
        exporter.ignored(now.0, now.1, now_s(), &mut |m| send(collectors, m));
    }
    sent
}
