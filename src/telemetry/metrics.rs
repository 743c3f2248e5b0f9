//! The Prometheus text exposition (format 0.0.4) of a [`Snapshot`].
//!
//! Names follow Prometheus conventions: prefix `dpuflow_`, base units, `_total` on
//! counters. Labels are bounded: ports, pipes, rules (at most `max_rule_series` of them;
//! the rest are summed under `rule="_other"`), meters, drop reasons. Flow identities (VNIs,
//! 5-tuples) are never labels: they belong to IPFIX.

use super::{CollectorStats, Snapshot, LATENCY_BUCKETS};
use crate::engine::DropReason;
use crate::firewall::conntrack::Invalid;
use crate::ir::Program;
use crate::kvcache::server::{
    Durations, KvCounters, KvGauges, KvService, COMMANDS, DURATION_BUCKETS, STORAGE_OPERATIONS,
    TIMED,
};
use prometheus::proto::{
    Bucket, Counter, Gauge, Histogram, LabelPair, Metric, MetricFamily, MetricType,
};
use prometheus::{Encoder, TextEncoder};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Facts about the process beside the counters.
#[derive(Debug, Clone)]
pub struct Info {
    pub version: String,
    pub backend: &'static str,
    /// Connection-table capacity over all workers.
    pub conntrack_limit: Option<u64>,
    /// Flow-cache capacity over all workers, when flows are exported.
    pub flow_limit: Option<u64>,
}

/// A thread's CPU time, and the part of it spent polling with nothing to do.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ThreadTimes {
    pub name: String,
    pub cpu_seconds: f64,
    /// Busy polling (`--busy-poll`), the time it found nothing to do; zero for a thread
    /// that sleeps when it has nothing to do (sleep takes no CPU time).
    pub idle_seconds: f64,
}

/// What the service says of itself at scrape time: the running pipeline's load, the
/// reloads tried since the start, and the CPU time of the threads running it.
#[derive(Debug, Clone, Default)]
pub struct ServiceState {
    /// Seconds it took to check and compile the running pipeline.
    pub seconds: f64,
    /// When it was loaded, in seconds since 1970.
    pub at_seconds: f64,
    pub reloads_succeeded: u64,
    pub reloads_failed: u64,
    /// The last reload was refused (the pipeline before it still runs).
    pub last_reload_failed: bool,
    /// The CPU time of the service's threads.
    pub threads: Vec<ThreadTimes>,
    /// Dataplane threads that have made no progress for the liveness check's limit.
    pub stalled_threads: usize,
    /// Per port: whether it reads or writes anything (a capture bound, or its interface
    /// open).
    pub ports_open: Vec<bool>,
    /// Per port: packets forwarded to it that were not sent.
    pub unsent: Vec<u64>,
    /// Per port: times its live port was closed to be opened again, by reason (in the
    /// order of [`PORT_CLOSE_REASONS`]).
    pub port_closes: Vec<[u64; PORT_CLOSE_REASONS.len()]>,
    /// The process as a whole, where /proc says.
    pub process: Option<crate::sys::ProcessStats>,
    /// Connections to the metrics endpoint closed unanswered (see [`super::http::Counts`]).
    pub endpoint_refused: u64,
    /// Connections to it ended by a TLS error; `None` when it does not serve TLS.
    pub endpoint_tls_failures: Option<u64>,
    /// Requests to it refused for want of credentials; `None` when it admits anyone.
    pub endpoint_auth_failures: Option<u64>,
}

/// Why a live port was closed to be opened again: the `reason` label of
/// `dpuflow_port_closed_total`.
pub const PORT_CLOSE_REASONS: [&str; 2] = ["interface_removed", "queues_changed"];

struct Families(Vec<MetricFamily>);

/// What a counter counts: events, or seconds.
trait CounterValue {
    fn value(self) -> f64;
}

impl CounterValue for u64 {
    fn value(self) -> f64 {
        self as f64
    }
}

impl CounterValue for f64 {
    fn value(self) -> f64 {
        self
    }
}

fn labels(pairs: &[(&str, &str)]) -> Vec<LabelPair> {
    pairs
        .iter()
        .map(|(k, v)| {
            let mut l = LabelPair::default();
            l.set_name((*k).to_owned());
            l.set_value((*v).to_owned());
            l
        })
        .collect()
}

impl Families {
    fn family(&mut self, name: &str, help: &str, kind: MetricType) -> &mut MetricFamily {
        let mut f = MetricFamily::default();
        f.set_name(name.to_owned());
        f.set_help(help.to_owned());
        f.set_field_type(kind);
        self.0.push(f);
        self.0.last_mut().expect("just pushed")
    }

    fn counter<V: CounterValue>(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (Vec<LabelPair>, V)>,
    ) {
        let f = self.family(name, help, MetricType::COUNTER);
        for (l, v) in series {
            let mut m = Metric::default();
            m.set_label(l);
            let mut c = Counter::default();
            c.set_value(v.value());
            m.set_counter(c);
            f.mut_metric().push(m);
        }
    }

    fn gauge(
        &mut self,
        name: &str,
        help: &str,
        series: impl IntoIterator<Item = (Vec<LabelPair>, f64)>,
    ) {
        let f = self.family(name, help, MetricType::GAUGE);
        for (l, v) in series {
            let mut m = Metric::default();
            m.set_label(l);
            let mut g = Gauge::default();
            g.set_value(v);
            m.set_gauge(g);
            f.mut_metric().push(m);
        }
    }
}

/// Renders the exposition of `snap` for `program`.
pub fn render(program: &Program, snap: &Snapshot, info: &Info, state: &ServiceState) -> String {
    let mut fam = Families(Vec::new());
    let s = &snap.stats;
    fam.gauge(
        "dpuflow_build_info",
        "dpuflow's version and backend; always 1.",
        [(
            labels(&[("version", &info.version), ("backend", info.backend)]),
            1.0,
        )],
    );
    fam.gauge(
        "dpuflow_pipeline_load_duration_seconds",
        "Time taken to check and compile the pipeline.",
        [(labels(&[("pipeline", &program.name)]), state.seconds)],
    );
    fam.gauge(
        "dpuflow_pipeline_last_load_timestamp_seconds",
        "When the running pipeline was loaded (at start or by a reload), in seconds since 1970.",
        [(labels(&[("pipeline", &program.name)]), state.at_seconds)],
    );
    fam.counter(
        "dpuflow_pipeline_reloads_total",
        "Reloads of the pipeline file (SIGHUP), by result: a failed one keeps the running pipeline.",
        [
            (labels(&[("result", "success")]), state.reloads_succeeded),
            (labels(&[("result", "failure")]), state.reloads_failed),
        ],
    );
    fam.gauge(
        "dpuflow_pipeline_last_reload_successful",
        "Whether the last reload succeeded (1 when none was tried).",
        [(vec![], if state.last_reload_failed { 0.0 } else { 1.0 })],
    );
    fam.gauge(
        "dpuflow_pipeline_ports",
        "Ports of the pipeline.",
        [(
            labels(&[("pipeline", &program.name)]),
            program.ports.len() as f64,
        )],
    );
    fam.gauge(
        "dpuflow_pipeline_pipes",
        "Pipes of the pipeline.",
        [(
            labels(&[("pipeline", &program.name)]),
            program.pipes.len() as f64,
        )],
    );
    fam.gauge(
        "dpuflow_pipeline_entries",
        "Rules and table entries of the pipeline.",
        [(
            labels(&[("pipeline", &program.name)]),
            program.entry_count() as f64,
        )],
    );

    let ports: Vec<&str> = program.ports.iter().map(|p| p.name.as_str()).collect();
    let per_port = |f: &dyn Fn(usize) -> u64| -> Vec<(Vec<LabelPair>, u64)> {
        ports
            .iter()
            .enumerate()
            .map(|(i, p)| {
                (
                    labels(&[("port", p)]),
                    if s.ports.is_empty() { 0 } else { f(i) },
                )
            })
            .collect()
    };
    fam.counter(
        "dpuflow_port_received_packets_total",
        "Packets received on the port.",
        per_port(&|i| s.ports[i].rx.packets),
    );
    fam.counter(
        "dpuflow_port_received_bytes_total",
        "Bytes received on the port.",
        per_port(&|i| s.ports[i].rx.bytes),
    );
    fam.counter(
        "dpuflow_port_transmitted_packets_total",
        "Packets sent out of the port.",
        per_port(&|i| s.ports[i].tx.packets),
    );
    fam.counter(
        "dpuflow_port_transmitted_bytes_total",
        "Bytes sent out of the port.",
        per_port(&|i| s.ports[i].tx.bytes),
    );
    let drops: Vec<(Vec<LabelPair>, u64)> = ports
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            DropReason::ALL.iter().map(move |r| {
                let n = s.ports.get(i).map_or(0, |ps| ps.drops[*r as usize]);
                (labels(&[("port", p), ("reason", r.name())]), n)
            })
        })
        .collect();
    fam.counter(
        "dpuflow_port_dropped_packets_total",
        "Packets received on the port and dropped, by reason.",
        drops,
    );
    fam.counter(
        "dpuflow_port_congestion_marked_packets_total",
        "Tunnelled packets received on the port whose outer header the fabric marked \
         Congestion Experienced, decapsulated with the mark carried inside (RFC 6040).",
        per_port(&|i| s.ports[i].congestion_marked),
    );
    fam.counter(
        "dpuflow_port_unsent_packets_total",
        "Packets forwarded to the port and not sent: its link down or its interface gone, \
         its transmit queue full, or no output bound to it.",
        ports.iter().enumerate().map(|(i, p)| {
            let unsent = state.unsent.get(i).copied().unwrap_or(0);
            (labels(&[("port", p)]), unsent)
        }),
    );
    fam.gauge(
        "dpuflow_port_open",
        "Whether the port is read or written: 1 while a capture is bound to it or its \
         interface is open; 0 for a port left unopened, or a live port waiting for its \
         interface (removed, or not there at the start).",
        ports.iter().enumerate().map(|(i, p)| {
            let open = state.ports_open.get(i).copied().unwrap_or(false);
            (labels(&[("port", p)]), if open { 1.0 } else { 0.0 })
        }),
    );

    fam.counter(
        "dpuflow_port_closed_total",
        "Times the live port was closed to be opened again: its interface removed, or its \
         receive queues changed (AF_XDP).",
        ports.iter().enumerate().flat_map(|(i, p)| {
            let closes = state.port_closes.get(i).copied().unwrap_or_default();
            PORT_CLOSE_REASONS
                .iter()
                .zip(closes)
                .map(move |(reason, n)| (labels(&[("port", p), ("reason", reason)]), n))
        }),
    );

    // Rules and table entries, in pipeline order, up to the cap; the rest summed.
    let cap = program.telemetry.max_rule_series as usize;
    let (mut rule_packets, mut rule_bytes) = (Vec::new(), Vec::new());
    let (mut other_packets, mut other_bytes, mut any_other) = (0u64, 0u64, false);
    let mut n = 0usize;
    // Only the labelled entries are named: naming a million table keys took most of a
    // second a scrape.
    for (pi, pipe) in program.pipes.iter().enumerate() {
        for ei in 0..=pipe.body.len() {
            let c = s
                .entries
                .get(pi)
                .and_then(|e| e.get(ei))
                .copied()
                .unwrap_or_default();
            if n < cap {
                let name = pipe.entry_name(ei);
                rule_packets.push((labels(&[("pipe", &pipe.name), ("rule", &name)]), c.packets));
                rule_bytes.push((labels(&[("pipe", &pipe.name), ("rule", &name)]), c.bytes));
            } else {
                any_other = true;
                other_packets += c.packets;
                other_bytes += c.bytes;
            }
            n += 1;
        }
    }
    if any_other {
        rule_packets.push((
            labels(&[("pipe", "_other"), ("rule", "_other")]),
            other_packets,
        ));
        rule_bytes.push((
            labels(&[("pipe", "_other"), ("rule", "_other")]),
            other_bytes,
        ));
    }
    fam.counter(
        "dpuflow_rule_matched_packets_total",
        "Packets a rule or table entry matched (a pipe's default is rule=\"default\").",
        rule_packets,
    );
    fam.counter(
        "dpuflow_rule_matched_bytes_total",
        "Bytes a rule or table entry matched.",
        rule_bytes,
    );

    let meters: Vec<(Vec<LabelPair>, u64)> = program
        .meters
        .iter()
        .enumerate()
        .flat_map(|(i, m)| {
            ["green", "yellow", "red"]
                .into_iter()
                .enumerate()
                .map(move |(c, color)| {
                    (
                        labels(&[("meter", &m.name), ("color", color)]),
                        s.meters.get(i).map_or(0, |v| v[c]),
                    )
                })
        })
        .collect();
    fam.counter(
        "dpuflow_meter_packets_total",
        "Packets a meter marked, by colour.",
        meters,
    );
    let services = |f: &dyn Fn(usize) -> u64| -> Vec<(Vec<LabelPair>, u64)> {
        program
            .services
            .iter()
            .enumerate()
            .map(|(i, sv)| {
                (
                    labels(&[("service", &sv.name)]),
                    if s.services.is_empty() { 0 } else { f(i) },
                )
            })
            .collect()
    };
    fam.counter(
        "dpuflow_service_queued_packets_total",
        "Packets handed to a local service.",
        services(&|i| s.services[i].packets),
    );
    fam.counter(
        "dpuflow_service_queued_bytes_total",
        "Bytes handed to a local service.",
        services(&|i| s.services[i].bytes),
    );

    if let Some(limit) = info.conntrack_limit {
        let ct = snap.conntrack.unwrap_or_default();
        fam.gauge(
            "dpuflow_conntrack_entries",
            "Connections tracked now.",
            [(vec![], ct.entries as f64)],
        );
        fam.gauge(
            "dpuflow_conntrack_limit",
            "Connections the tables can hold.",
            [(vec![], limit as f64)],
        );
        fam.counter(
            "dpuflow_conntrack_inserts_total",
            "Connections created.",
            [(vec![], ct.inserts)],
        );
        fam.counter(
            "dpuflow_conntrack_expirations_total",
            "Connections removed after their timeout.",
            [(vec![], ct.expirations)],
        );
        fam.counter(
            "dpuflow_conntrack_full_drops_total",
            "New connections refused because the table was full.",
            [(vec![], ct.drops_full)],
        );
        fam.counter(
            "dpuflow_conntrack_early_drops_total",
            "Unconfirmed connections removed to make room for new ones in a full table.",
            [(vec![], ct.early_drops)],
        );
        fam.counter(
            "dpuflow_conntrack_invalid_packets_total",
            "Packets conntrack judged invalid, by reason.",
            Invalid::ALL
                .iter()
                .map(|&r| (labels(&[("reason", r.name())]), ct.invalid[r as usize])),
        );
    }

    if let Some(limit) = info.flow_limit {
        let fl = snap.flows.unwrap_or_default();
        fam.gauge(
            "dpuflow_flow_cache_entries",
            "Flows held in the IPFIX flow caches now.",
            [(vec![], fl.flows as f64)],
        );
        fam.gauge(
            "dpuflow_flow_cache_limit",
            "Flows the caches can hold.",
            [(vec![], limit as f64)],
        );
        fam.counter(
            "dpuflow_flow_cache_full_packets_total",
            "Packets of flows the caches had no room for; those flows are not exported.",
            [(vec![], fl.full_packets)],
        );
        fam.counter(
            "dpuflow_flow_records_total",
            "Flow records handed to the IPFIX exporter.",
            [(vec![], fl.records)],
        );
        fam.counter(
            "dpuflow_flow_records_lost_total",
            "Flow records of connections lost because the exporter fell behind.",
            [(vec![], fl.lost_records)],
        );
        let ex = snap.export.clone().unwrap_or_default();
        let each = |count: fn(&CollectorStats) -> u64| {
            (ex.collectors.iter()).map(move |c| (labels(&[("collector", &c.collector)]), count(c)))
        };
        fam.counter(
            "dpuflow_ipfix_messages_total",
            "IPFIX messages sent to the collector.",
            each(|c| c.messages),
        );
        fam.counter(
            "dpuflow_ipfix_send_failures_total",
            "IPFIX messages the socket would not send (their records are lost to that collector).",
            each(|c| c.failed),
        );
        fam.counter(
            "dpuflow_ipfix_pacing_seconds_total",
            "Time the IPFIX export waited to keep to its rate (ipfix_rate); near a second a second, records leave later than their flows' timeouts.",
            [(vec![], ex.paced_ns as f64 / 1e9)],
        );
    }

    let mut threads = state.threads.clone();
    threads.sort_by(|a, b| a.name.cmp(&b.name));
    fam.counter(
        "dpuflow_thread_cpu_seconds_total",
        "CPU time of the service's dataplane threads (io, worker-N, ipfix), user and system: the rate of a thread's, less that of its idle time, is how busy it is.",
        threads.iter().map(|t| (labels(&[("thread", &t.name)]), t.cpu_seconds)),
    );
    fam.counter(
        "dpuflow_thread_idle_seconds_total",
        "Wall time a dataplane thread spent polling with nothing to do: with --busy-poll, where it never sleeps; otherwise 0 (its waits take no CPU time).",
        threads.iter().map(|t| (labels(&[("thread", &t.name)]), t.idle_seconds)),
    );
    fam.gauge(
        "dpuflow_dataplane_stalled_threads",
        "Dataplane threads that have made no progress for 5 s or more (/healthz names them).",
        [(vec![], state.stalled_threads as f64)],
    );
    fam.counter(
        "dpuflow_metrics_endpoint_refused_connections_total",
        "Connections to this endpoint closed unanswered: as many as it answers at once were open.",
        [(vec![], state.endpoint_refused)],
    );
    if let Some(failures) = state.endpoint_tls_failures {
        fam.counter(
            "dpuflow_metrics_endpoint_tls_failures_total",
            "Connections to this endpoint ended by a TLS error: a client that does not trust its certificate, one without a trusted certificate of its own, plain HTTP.",
            [(vec![], failures)],
        );
    }
    if let Some(failures) = state.endpoint_auth_failures {
        fam.counter(
            "dpuflow_metrics_endpoint_auth_failures_total",
            "Requests for /metrics refused for want of a user's name and password (basic auth).",
            [(vec![], failures)],
        );
    }

    // The names every Prometheus client library gives these, so that dashboards made for
    // any process work.
    if let Some(p) = state.process {
        fam.counter(
            "process_cpu_seconds_total",
            "CPU time of the whole process, user and system.",
            [(vec![], p.cpu_seconds)],
        );
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Memory of the process resident in RAM.",
                p.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Address space the process has mapped.",
                p.virtual_bytes as f64,
            ),
            (
                "process_threads",
                "Threads of the process (each KV-cache client has one).",
                p.threads as f64,
            ),
            (
                "process_open_fds",
                "File descriptors the process holds open.",
                p.open_fds as f64,
            ),
            (
                "process_max_fds",
                "How many file descriptors the process may hold open (its soft limit).",
                p.max_fds as f64,
            ),
            (
                "process_start_time_seconds",
                "When the process started, in seconds since 1970.",
                p.start_seconds,
            ),
        ] {
            fam.gauge(name, help, [(vec![], value)]);
        }
    }

    let l = &snap.latency;
    fam.family(
        "dpuflow_processing_latency_seconds",
        "Time a packet spends in the engine, sampled a batch at a time.",
        MetricType::HISTOGRAM,
    )
    .mut_metric()
    .push(histogram(
        vec![],
        &LATENCY_BUCKETS,
        &l.buckets,
        l.count,
        l.sum_seconds,
    ));

    fam.encode()
}

/// The histogram series of `d`, labelled `labels`.
fn durations(labels: Vec<LabelPair>, d: &Durations) -> Metric {
    let counts: Vec<u64> = d.buckets.iter().map(|b| b.load(Relaxed)).collect();
    histogram(
        labels,
        &DURATION_BUCKETS,
        &counts,
        d.count.load(Relaxed),
        d.sum_ns.load(Relaxed) as f64 / 1e9,
    )
}

/// A histogram series from per-bucket (not cumulative) counts over `bounds`.
fn histogram(
    labels: Vec<LabelPair>,
    bounds: &[f64],
    counts: &[u64],
    count: u64,
    sum_seconds: f64,
) -> Metric {
    let mut h = Histogram::default();
    let mut cumulative = 0;
    let mut buckets = Vec::new();
    for (bound, n) in bounds.iter().zip(counts) {
        cumulative += n;
        let mut b = Bucket::default();
        b.set_upper_bound(*bound);
        b.set_cumulative_count(cumulative);
        buckets.push(b);
    }
    h.set_bucket(buckets);
    h.set_sample_count(count);
    h.set_sample_sum(sum_seconds);
    let mut m = Metric::default();
    m.set_label(labels);
    m.set_histogram(h);
    m
}

/// Renders the exposition of the KV-cache services (appended to [`render`]'s).
pub fn render_kv(services: &[Arc<KvService>]) -> String {
    let mut fam = Families(Vec::new());
    let gauges: Vec<KvGauges> = services.iter().map(|s| s.gauges()).collect();
    // One series a service: what `f` reads from the service and its index's gauges.
    let per = |f: &dyn Fn(&KvService, &KvGauges) -> u64| {
        services
            .iter()
            .zip(&gauges)
            .map(|(s, g)| (labels(&[("service", &s.name)]), f(s, g)))
            .collect::<Vec<_>>()
    };
    let as_gauge =
        |series: Vec<(Vec<LabelPair>, u64)>| series.into_iter().map(|(l, v)| (l, v as f64));
    fam.gauge(
        "dpuflow_kvcache_keys",
        "Keys held.",
        as_gauge(per(&|_, g| g.keys)),
    );
    fam.gauge(
        "dpuflow_kvcache_restored_keys",
        "Keys the start restored from the index saved on the target (at a clean stop or by a checkpoint; 0: started empty).",
        as_gauge(per(&|s, _| s.restored_keys)),
    );
    fam.gauge(
        "dpuflow_kvcache_last_checkpoint_timestamp_seconds",
        "When a checkpoint last saved the index on the target, unix time (0: none since the start).",
        per(&|s, _| s.counters.last_save_ms.load(Relaxed))
            .into_iter()
            .map(|(l, ms)| (l, ms as f64 / 1000.0)),
    );
    fam.gauge(
        "dpuflow_kvcache_capacity_bytes",
        "Storage the service may fill, in whole blocks.",
        as_gauge(per(&|_, g| g.capacity_bytes)),
    );
    fam.gauge(
        "dpuflow_kvcache_used_bytes",
        "Storage held by values, in whole blocks.",
        as_gauge(per(&|_, g| g.used_bytes)),
    );
    fam.gauge(
        "dpuflow_kvcache_inline_bytes",
        "Bytes of values kept in memory beside their blocks (inline_max), read without the target.",
        as_gauge(per(&|_, g| g.inline_bytes)),
    );
    fam.gauge(
        "dpuflow_kvcache_handoff_keys",
        "Keys held of hash slots the cluster's node list gave another node, not yet handed to it.",
        as_gauge(per(&|s, _| s.counters.handoffs.waiting())),
    );
    fam.gauge(
        "dpuflow_kvcache_clients",
        "Client connections open.",
        as_gauge(per(&|s, _| s.counters.clients.load(Relaxed))),
    );
    let commands = services.iter().flat_map(|s| {
        COMMANDS.iter().enumerate().map(|(i, c)| {
            (
                labels(&[("service", &s.name), ("command", c)]),
                s.counters.commands[i].load(Relaxed),
            )
        })
    });
    fam.counter(
        "dpuflow_kvcache_commands_total",
        "Requests by command (others under `other`).",
        commands,
    );
    type Field = fn(&KvCounters) -> &AtomicU64;
    let counters: [(&str, &str, Field); 18] = [
        ("dpuflow_kvcache_hits_total", "Reads of keys held.", |c| {
            &c.hits
        }),
        (
            "dpuflow_kvcache_misses_total",
            "Reads of keys not held.",
            |c| &c.misses,
        ),
        (
            "dpuflow_kvcache_storage_read_bytes_total",
            "Value bytes read from the storage target.",
            |c| &c.read_bytes,
        ),
        (
            "dpuflow_kvcache_storage_written_bytes_total",
            "Value bytes written to the storage target.",
            |c| &c.written_bytes,
        ),
        (
            "dpuflow_kvcache_storage_errors_total",
            "Storage reads and writes that failed.",
            |c| &c.storage_errors,
        ),
        (
            "dpuflow_kvcache_corrupt_values_total",
            "Values read back that did not match their checksum (answered as misses, keys removed).",
            |c| &c.corrupt_values,
        ),
        (
            "dpuflow_kvcache_connections_total",
            "Client connections accepted.",
            |c| &c.connections,
        ),
        (
            "dpuflow_kvcache_client_received_bytes_total",
            "Bytes read from clients' connections (inside TLS, where configured).",
            |c| &c.client_read_bytes,
        ),
        (
            "dpuflow_kvcache_client_sent_bytes_total",
            "Bytes written to clients' connections (inside TLS, where configured).",
            |c| &c.client_written_bytes,
        ),
        (
            "dpuflow_kvcache_rejected_clients_total",
            "Connections refused because the service had its most clients.",
            |c| &c.rejected_clients,
        ),
        (
            "dpuflow_kvcache_redirected_requests_total",
            "Requests a cluster node answered MOVED or CROSSSLOT rather than served.",
            |c| &c.redirected,
        ),
        (
            "dpuflow_kvcache_handed_off_keys_total",
            "Keys of hash slots the cluster's node list gave another node, taken by that node (or held there already).",
            |c| &c.handed_off,
        ),
        (
            "dpuflow_kvcache_auth_failures_total",
            "AUTH (or HELLO AUTH) with a wrong password.",
            |c| &c.auth_failures,
        ),
        (
            "dpuflow_kvcache_tls_failures_total",
            "Connections ended by a TLS error (failed handshake, bad record).",
            |c| &c.tls_failures,
        ),
        (
            "dpuflow_kvcache_discarded_bytes_total",
            "Bytes of freed blocks the target was told no longer hold data (discard on).",
            |c| &c.discarded_bytes,
        ),
        (
            "dpuflow_kvcache_discard_failures_total",
            "Discards of freed blocks the target refused or failed (the blocks are used again all the same).",
            |c| &c.discard_failures,
        ),
        (
            "dpuflow_kvcache_checkpoint_deltas_total",
            "Checkpoints saved as the keys changed since the one before (the others saved the whole index).",
            |c| &c.checkpoint_deltas,
        ),
        (
            "dpuflow_kvcache_checkpoint_written_bytes_total",
            "Bytes of index snapshots and deltas written by checkpoints.",
            |c| &c.checkpoint_bytes,
        ),
    ];
    for (name, help, field) in counters {
        fam.counter(name, help, per(&|s, _| field(&s.counters).load(Relaxed)));
    }
    let by_target = services
        .iter()
        .flat_map(|s| {
            s.target_failures()
                .counts()
                .map(|(target, n)| (labels(&[("service", &s.name), ("target", target)]), n))
                .collect::<Vec<_>>()
        })
        .collect::<Vec<_>>();
    fam.counter(
        "dpuflow_kvcache_target_errors_total",
        "Reads, writes, flushes and discards that failed on each storage target, after one more try on a fresh connection (a striped store's failures, by target).",
        by_target,
    );
    fam.counter(
        "dpuflow_kvcache_evictions_total",
        "Keys evicted (least recently used) to make room.",
        per(&|_, g| g.evictions),
    );
    fam.counter(
        "dpuflow_kvcache_checkpoints_total",
        "Checkpoints of the index saved on the target.",
        per(&|s, _| s.counters.checkpoints.load(Relaxed)),
    );
    fam.counter(
        "dpuflow_kvcache_checkpoint_failures_total",
        "Checkpoints that failed (the target keeps the one before).",
        per(&|s, _| s.counters.checkpoint_failures.load(Relaxed)),
    );
    fam.counter(
        "dpuflow_kvcache_checkpoint_overruns_total",
        "Times blocks the last checkpoint names were used before the next was durable: by values written between two that outgrew the free reserve, or by a checkpoint short of room that then failed (keys there read as misses after a crash).",
        per(&|_, g| g.hold_back_overruns),
    );
    fam.counter(
        "dpuflow_kvcache_expired_keys_total",
        "Keys removed for having passed their deadline (EXPIRE, SET EX).",
        per(&|_, g| g.expired),
    );
    let f = fam.family(
        "dpuflow_kvcache_request_duration_seconds",
        "Time from a request read to its reply ready, storage I/O included.",
        MetricType::HISTOGRAM,
    );
    for s in services {
        for (command, d) in TIMED.iter().zip(&s.counters.durations) {
            f.mut_metric().push(durations(
                labels(&[("service", &s.name), ("command", command)]),
                d,
            ));
        }
    }
    let f = fam.family(
        "dpuflow_kvcache_storage_duration_seconds",
        "Time a value's reads or writes took on a storage target connection, all its pieces.",
        MetricType::HISTOGRAM,
    );
    for s in services {
        for (operation, d) in STORAGE_OPERATIONS.iter().zip(&s.counters.storage) {
            f.mut_metric().push(durations(
                labels(&[("service", &s.name), ("operation", operation)]),
                d,
            ));
        }
    }
    let f = fam.family(
        "dpuflow_kvcache_connection_wait_seconds",
        "Time requests waited for a free storage target connection (all `connections` busy).",
        MetricType::HISTOGRAM,
    );
    for s in services {
        f.mut_metric().push(durations(
            labels(&[("service", &s.name)]),
            &s.counters.connection_waits,
        ));
    }
    fam.encode()
}

impl Families {
    fn encode(mut self) -> String {
        // A family without series (no meters, no services) is not valid exposition.
        self.0.retain(|f| !f.get_metric().is_empty());
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.0, &mut out) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}
