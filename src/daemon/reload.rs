//! Reloading the pipeline file on SIGHUP, without stopping the traffic. The control
//! thread reads, checks and compiles the file again; a file with errors, or one whose
//! changes only a restart can apply, leaves the running pipeline as it is. Otherwise the
//! new program is published under the next generation number, and each worker takes it
//! between two batches (one atomic load a batch to notice), keeping its connections, its
//! flows and its counters (rules and meters by name). A second reload waits until every
//! worker runs the first.
//!
//! What a reload cannot change — the ports, the local services, the connection table's
//! capacity and window tracking, the telemetry block — is named in the refusal: the
//! packet sockets, the tables' memory and the exporters were made for the old values.
//! A KV-cache service's cluster node list is the exception: its service takes the new
//! one at once (`KvService::regroup`).

use crate::engine::{Compiled, Renumbering, SharedMeter};
use crate::ir::{Program, Service, ServiceKind, Telemetry};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// What `dpuflow run`'s flags set in place of the pipeline's `telemetry` block: applied
/// to the file as started, and again to each reload of it.
#[derive(Debug, Clone, Default)]
pub struct TelemetryFlags {
    pub sampling: Option<u32>,
    pub observation_domain: Option<u32>,
    pub ipfix_mtu: Option<u16>,
    pub ipfix_rate: Option<u32>,
}

impl TelemetryFlags {
    pub fn apply(&self, t: &mut Telemetry) {
        if let Some(n) = self.sampling {
            t.sampling = n;
        }
        if let Some(id) = self.observation_domain {
            t.observation_domain = id;
        }
        if let Some(mtu) = self.ipfix_mtu {
            t.ipfix_mtu = mtu;
        }
        if let Some(rate) = self.ipfix_rate {
            t.ipfix_rate = rate;
        }
    }
}

/// The pipeline file a service runs, read again on SIGHUP.
#[derive(Debug, Clone)]
pub struct PipelineFile {
    pub path: PathBuf,
    pub telemetry: TelemetryFlags,
}

/// One loaded pipeline: what the workers run from the generation on.
#[derive(Debug)]
pub struct Loaded {
    /// 0 for the pipeline the service started with, then one more each reload.
    pub generation: u64,
    pub program: Program,
    /// The program compiled once, run by every worker's engine.
    pub code: Arc<Compiled>,
    /// The meters' buckets, which the workers share; empty with one worker, whose engine
    /// meters alone.
    pub meters: Vec<Arc<SharedMeter>>,
    /// From the previous generation's counters to this one's.
    pub renumbering: Renumbering,
    /// Seconds it took to check and compile.
    pub seconds: f64,
    /// When it was loaded.
    pub at: SystemTime,
}

impl Loaded {
    /// The first pipeline, compiled for `workers` workers.
    /// The pipeline the service starts with, compiled into `code`.
    pub fn first(program: Program, code: Arc<Compiled>, seconds: f64, workers: usize) -> Loaded {
        Loaded {
            generation: 0,
            meters: shared_meters(&code, workers),
            code,
            renumbering: Renumbering::default(),
            program,
            seconds,
            at: SystemTime::now(),
        }
    }

    /// Seconds since 1970 when it was loaded.
    pub fn at_seconds(&self) -> f64 {
        self.at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64())
    }
}

/// Buckets the workers share, when there are several.
fn shared_meters(code: &Compiled, workers: usize) -> Vec<Arc<SharedMeter>> {
    if workers > 1 {
        code.shared_meters()
    } else {
        Vec::new()
    }
}

/// Why a reload left the running pipeline in place.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// the file could not be read
    #[error("cannot read {path}: {source}")]
    Unreadable {
        path: String,
        source: std::io::Error,
    },
    /// the file has errors
    #[error("the pipeline has errors:\n{0}")]
    Invalid(String),
    /// the file changes what only a restart applies
    #[error("{0}: restart the service to apply")]
    NeedsRestart(String),
    /// the ports' fanout groups could not be steered for the new pipeline
    #[error("{0}")]
    Steering(String),
    /// no thread could be started to load the file
    #[error("cannot start a thread to load the file: {0}")]
    Thread(std::io::Error),
}

/// What of `new` a service started with `old` cannot take without a restart, each named;
/// empty when a reload can apply it all.
pub fn restart_needed(old: &Program, new: &Program) -> Vec<String> {
    let mut why = Vec::new();
    if old.ports.len() != new.ports.len() {
        why.push(format!(
            "the ports changed ({} before, {} now)",
            old.ports.len(),
            new.ports.len()
        ));
    } else if let Some((o, _)) = old.ports.iter().zip(&new.ports).find(|(o, n)| o != n) {
        why.push(format!("port `{}` changed", o.name));
    }
    if restarting(&old.services) != restarting(&new.services) {
        why.push("the local services changed".into());
    }
    match (&old.conntrack, &new.conntrack) {
        (None, Some(_)) => why.push("a `conntrack` block was added".into()),
        (Some(_), None) => why.push("the `conntrack` block was removed".into()),
        (Some(o), Some(n)) if o.capacity != n.capacity => {
            why.push("the connection table's capacity changed".into())
        }
        (Some(o), Some(n)) if o.tcp_window != n.tcp_window => {
            why.push("`tcp_window` changed".into())
        }
        _ => {}
    }
    if old.telemetry != new.telemetry {
        why.push("the `telemetry` block changed".into());
    }
    why
}

/// `services` as far as only a restart changes them: not a KV-cache service's cluster
/// node list, or whether it is leaving the cluster ([`regrouped`]).
fn restarting(services: &[Service]) -> Vec<Service> {
    let mut services = services.to_vec();
    for s in &mut services {
        let ServiceKind::KvCache(c) = &mut s.kind;
        c.cluster.clear();
        c.cluster_leaving = false;
    }
    services
}

/// The KV-cache services of `new` whose cluster node list (or whether they are leaving)
/// is not what it was in `old`: their names, and the list and leaving they take now.
pub fn regrouped<'a>(old: &Program, new: &'a Program) -> Vec<(&'a str, &'a [SocketAddr], bool)> {
    let cluster = |s: &Service| {
        let ServiceKind::KvCache(c) = &s.kind;
        (c.cluster.clone(), c.cluster_leaving)
    };
    (new.services.iter())
        .filter(|n| {
            let before = old.services.iter().find(|o| o.name == n.name);
            before.is_some_and(|o| cluster(o) != cluster(n))
        })
        .map(|n| {
            let ServiceKind::KvCache(c) = &n.kind;
            (n.name.as_str(), &c.cluster[..], c.cluster_leaving)
        })
        .collect()
}

/// Reads, checks and compiles `file` as the successor of `current`, for `workers`
/// workers: the next [`Loaded`], or why not. Warnings are logged.
pub fn load_next(
    file: &PipelineFile,
    current: &Loaded,
    workers: usize,
) -> Result<Loaded, ReloadError> {
    let started = Instant::now();
    let checked =
        crate::lang::check_file(&file.path).map_err(|source| ReloadError::Unreadable {
            path: file.path.display().to_string(),
            source,
        })?;
    let said = checked.render();
    let Some(mut program) = checked.program else {
        return Err(ReloadError::Invalid(said));
    };
    if !said.is_empty() {
        tracing::warn!(diagnostics = %said, "the reloaded pipeline has warnings");
    }
    file.telemetry.apply(&mut program.telemetry);
    let why = restart_needed(&current.program, &program);
    if !why.is_empty() {
        return Err(ReloadError::NeedsRestart(why.join("; ")));
    }
    let code = Arc::new(Compiled::new(&program));
    Ok(Loaded {
        generation: current.generation + 1,
        meters: shared_meters(&code, workers),
        code,
        renumbering: Renumbering::between(&current.program, &program),
        program,
        seconds: started.elapsed().as_secs_f64(),
        at: SystemTime::now(),
    })
}

/// How often the control thread looks for a SIGHUP, and for workers yet to take a reload.
pub const POLL: Duration = Duration::from_millis(50);

#[cfg(test)]
mod tests {
    use super::*;

    fn program(text: &str) -> Program {
        crate::lang::check_source("p.pipe", text, std::path::Path::new("."))
            .program
            .expect("valid")
    }

    const BASE: &str = "pipeline p\n\
        port a { driver af_packet iface \"a0\" }\n\
        port b { driver af_packet iface \"b0\" }\n\
        conntrack { capacity 1000 }\n\
        pipe f root from a { default { actions ct.commit, fwd b } }\n";

    #[test]
    fn rules_and_timeouts_reload_but_ports_and_tables_need_a_restart() {
        let old = program(BASE);
        let rules = BASE.replace("actions ct.commit, fwd b", "actions drop");
        assert_eq!(restart_needed(&old, &program(&rules)), Vec::<String>::new());
        let timeouts = BASE.replace("capacity 1000", "capacity 1000 timeout udp 5s");
        assert_eq!(
            restart_needed(&old, &program(&timeouts)),
            Vec::<String>::new()
        );

        let iface = BASE.replace("\"b0\"", "\"b1\"");
        assert_eq!(restart_needed(&old, &program(&iface)), ["port `b` changed"]);
        let capacity = BASE.replace("capacity 1000", "capacity 2000");
        assert_eq!(
            restart_needed(&old, &program(&capacity)),
            ["the connection table's capacity changed"]
        );
        let telemetry = format!("{BASE}telemetry {{ prometheus 127.0.0.1:9999 }}\n");
        assert_eq!(
            restart_needed(&old, &program(&telemetry)),
            ["the `telemetry` block changed"]
        );
    }

    #[test]
    fn a_kv_cache_clusters_node_list_reloads_but_the_rest_of_the_service_needs_a_restart() {
        let kv = |capacity: &str, options: &str| {
            program(&format!(
                "pipeline p\nport a {{ driver pcap }}\n\
                 service kvcache {{ listen 127.0.0.1:7000 target \"file:///tmp/kv.img\" \
                 capacity {capacity} {options} }}\n\
                 pipe f root from a {{ default {{ actions to kvcache }} }}\n"
            ))
        };
        let alone = kv("64MiB", "cluster_node 127.0.0.1:7000");
        let two = kv(
            "64MiB",
            "cluster_node 127.0.0.1:7000 cluster_node 127.0.0.1:7001",
        );
        assert_eq!(restart_needed(&alone, &two), Vec::<String>::new());
        let nodes: [SocketAddr; 2] = [
            "127.0.0.1:7000".parse().unwrap(),
            "127.0.0.1:7001".parse().unwrap(),
        ];
        assert_eq!(regrouped(&alone, &two), [("kvcache", &nodes[..], false)]);
        let leaving = kv("64MiB", "cluster_node 127.0.0.1:7001 cluster_leaving on");
        assert_eq!(regrouped(&two, &leaving), [("kvcache", &nodes[1..], true)]);
        assert!(regrouped(&two, &two).is_empty());
        let bigger = kv("128MiB", "cluster_node 127.0.0.1:7000");
        assert_eq!(
            restart_needed(&alone, &bigger),
            ["the local services changed"]
        );
    }
}
