//! The `dpuflow` command line.

use clap::{Parser, Subcommand, ValueEnum};
use dpuflow::engine::{Engine, NoObserver};
use dpuflow::ir::{PortId, Program};
use dpuflow::lang::{self, Severity};
use dpuflow::replay::Bindings;
use dpuflow::trace::Tracer;
use dpuflow::traffic::{Conversations, Cycle, Source};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(name = "dpuflow", version = dpuflow::VERSION, about = "Packet pipelines for NVIDIA BlueField DPUs", long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check pipeline files and report errors and warnings.
    ///
    /// Exits 0 when every file is valid (warnings allowed), 1 when any has an error,
    /// 2 when a file cannot be read.
    #[command(
        after_help = "Example:\n  dpuflow check pipelines/*.pipe\n  dpuflow check --format json pipelines/stateful-firewall.pipe"
    )]
    Check {
        /// Pipeline files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// How to print diagnostics: rustc-style text on stderr, or JSON lines on stdout.
        #[arg(long, value_enum, default_value_t = Format::Human)]
        format: Format,
    },
    /// Print a pipeline's ports, pipes, rules and their edges as a Graphviz DOT graph.
    #[command(
        after_help = "Example:\n  dpuflow graph pipelines/vxlan-gateway.pipe | dot -Tsvg > vxlan-gateway.svg"
    )]
    Graph {
        /// Pipeline file.
        file: PathBuf,
    },
    /// Print the DOCA Flow plan of a pipeline: the pipes, templates and entries the DOCA
    /// backend creates on a BlueField, and the pipes it leaves to the software backend.
    ///
    /// Every port is planned as a DOCA port, whatever its driver.
    #[command(after_help = "Example:\n  dpuflow plan pipelines/vxlan-gateway.pipe")]
    Plan {
        /// Pipeline file.
        file: PathBuf,
        /// Exit 3 when any pipe or rule of the pipeline would run in software (a
        /// deployment that must be entirely in the NIC can check for it).
        #[arg(long)]
        hardware_only: bool,
        /// Print, instead of the plan, the calls installing it would make: every
        /// shared resource, pipe and entry with the bytes of each member it sets.
        #[arg(long)]
        calls: bool,
    },
    /// Run capture files through a pipeline with the software engine.
    ///
    /// Inputs are merged in timestamp order (ties go to the input named first); time in
    /// the engine is the packets' capture time, so the same inputs always give the same
    /// outputs. Prints per-port and per-entry counters at the end.
    #[command(
        after_help = "Example:\n  dpuflow replay pipelines/vxlan-gateway.pipe --in host=host.pcap --out uplink=uplink.pcap"
    )]
    Replay {
        /// Pipeline file.
        pipeline: PathBuf,
        /// An input capture (pcap or pcapng) received on PORT.
        #[arg(long = "in", value_name = "PORT=FILE")]
        inputs: Vec<String>,
        /// Where packets sent out of PORT are written (pcap).
        #[arg(long = "out", value_name = "PORT=FILE")]
        outputs: Vec<String>,
        /// Packets per batch.
        #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024))]
        batch: u16,
        /// Print the summary as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show each packet's walk through the pipeline: pipes, matched entries, actions, fate.
    #[command(
        after_help = "Example:\n  dpuflow trace pipelines/vxlan-gateway.pipe --in uplink=uplink.pcap --packet 3"
    )]
    Trace {
        /// Pipeline file.
        pipeline: PathBuf,
        /// An input capture (pcap or pcapng) received on PORT.
        #[arg(long = "in", value_name = "PORT=FILE", required = true)]
        inputs: Vec<String>,
        /// Trace only this packet (1-based, in replay order).
        #[arg(long, value_name = "N")]
        packet: Option<u64>,
    },
    /// Run a pipeline as a service: workers process the inputs, metrics are served over
    /// HTTP, SIGTERM or SIGINT stops it gracefully (in-flight batches finished, outputs
    /// flushed, exit 0; a second signal ends it at once, exit 1), SIGHUP reloads the
    /// pipeline file while packets flow.
    ///
    /// A reload keeps tracked connections and counters; one whose file has errors, or
    /// changes the ports, services, the connection table's capacity or tcp_window, or the
    /// telemetry block, is refused with the reason logged, and the running pipeline kept.
    /// SIGHUP also reads the TLS certificates and keys (of the metrics endpoint and the
    /// KV-cache services) and the metrics endpoint's users' file again, so rotated ones
    /// serve new connections.
    ///
    /// Ports of `driver af_packet` or `af_xdp` not bound to a capture are opened on their interfaces
    /// (live: it runs until signalled); otherwise, without --loop, it runs until the
    /// captures are read and then, with a metrics endpoint, keeps serving until signalled.
    /// A pipeline's KV-cache services (`service kvcache`) start first and serve until
    /// signalled, saving their index at the stop; such a pipeline needs no packet input.
    /// Flags override the pipeline's telemetry block.
    ///
    /// A live port whose interface is removed is closed until an interface of its name is
    /// back (/readyz says not ready meanwhile). A thread that fails, or a capture that can
    /// no longer be read or written, stops it as a signal does, with exit status 2.
    #[command(
        after_help = "Example:\n  dpuflow run pipelines/vxlan-gateway.pipe --in host=host.pcap --out uplink=uplink.pcap --metrics 127.0.0.1:9464\n  curl -s 127.0.0.1:9464/metrics"
    )]
    Run(RunFlags),
    /// The firewall's rule classifier: classify traces, benchmark, generate traces.
    Acl {
        #[command(subcommand)]
        command: AclCommand,
    },
    /// Measure the software engine on one core with synthetic traffic made to hit the
    /// entries of a port's root pipe.
    #[command(
        after_help = "Example:\n  dpuflow bench pipelines/vxlan-gateway.pipe --port uplink --size 64 --flows 1024 --packets 20000000"
    )]
    Bench(BenchFlags),
    /// The KV-cache service's store, looked at from outside the service.
    Kv {
        #[command(subcommand)]
        command: KvCommand,
    },
}

/// The KV-cache service's store on its target.
#[derive(Subcommand, Debug)]
enum KvCommand {
    /// Print, for each KV-cache service of a pipeline, what the index saved on its target
    /// holds: what the service's next start restores. Nothing is written; a running
    /// service's target may be read (its last checkpoint is what a crash would restore).
    ///
    /// Exits 0 when every target was read (saved index or not), 1 when one could not be.
    #[command(after_help = "Example:\n  dpuflow kv inspect pipelines/kv-offload.pipe")]
    Inspect {
        /// Pipeline file.
        file: PathBuf,
        /// Only the service of this name.
        #[arg(long)]
        service: Option<String>,
    },
}

/// The firewall's rule classifier on ClassBench rule sets (the files `dpdk-test-acl` reads).
#[derive(Subcommand, Debug)]
enum AclCommand {
    /// Print, for each trace packet, the 0-based index of the first matching rule, or -1.
    #[command(
        after_help = "Example:\n  dpuflow acl classify --rules acl1_10k --trace acl1_10k.trace"
    )]
    Classify {
        /// Rule file (ClassBench format).
        #[arg(long)]
        rules: PathBuf,
        /// Trace: one packet a line, `SRC DST SPORT DPORT PROTO`.
        #[arg(long)]
        trace: PathBuf,
        /// IPv6 rules and trace, in the format `dpdk-test-acl --ipv6` reads.
        #[arg(long)]
        ipv6: bool,
    },
    /// Measure lookups on one core, the build time and the memory; with --updates, the
    /// update rate sustained while lookups run.
    #[command(
        after_help = "Example:\n  dpuflow acl bench --rules acl1_10k --trace acl1_10k.trace --batch 32 --updates 1"
    )]
    Bench {
        #[arg(long)]
        rules: PathBuf,
        #[arg(long)]
        trace: PathBuf,
        /// Keys classified per call.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Passes over the trace.
        #[arg(long, default_value_t = 10)]
        iter: u32,
        /// Rule updates (deletes and re-inserts of random rules) a second thread makes
        /// while the lookups run.
        #[arg(long, default_value_t = 0)]
        updates: u64,
        /// The updates insert rules new to the trees instead (copies of random rules at
        /// priorities after the set's), which rebuilds fold in.
        #[arg(long, requires = "updates")]
        new_rules: bool,
        /// IPv6 rules and trace, in the format `dpdk-test-acl --ipv6` reads.
        #[arg(long)]
        ipv6: bool,
    },
    /// Write a trace: packets drawn inside random rules' ranges, plus uniformly random ones.
    #[command(
        after_help = "Example:\n  dpuflow acl gen-trace --rules acl1_10k --count 100000 --seed 1 > acl1_10k.trace"
    )]
    GenTrace {
        #[arg(long)]
        rules: PathBuf,
        #[arg(long)]
        count: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

/// `dpuflow run`'s arguments.
#[derive(clap::Args, Debug)]
struct RunFlags {
    /// Pipeline file.
    pipeline: PathBuf,
    /// An input capture (pcap or pcapng) received on PORT, in place of its interface.
    #[arg(long = "in", value_name = "PORT=FILE")]
    inputs: Vec<String>,
    /// Where packets sent out of PORT are written (pcap), in place of its interface.
    #[arg(long = "out", value_name = "PORT=FILE")]
    outputs: Vec<String>,
    /// Address of the Prometheus endpoint (default: the pipeline's `prometheus`, else
    /// 127.0.0.1:9464).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// IPFIX collector: IP:PORT, or NAME:PORT (resolved at start, then every 30 s: the
    /// export follows the collector if it moves). Given more than once, every message
    /// goes to each (default: the pipeline's `ipfix` collectors).
    #[arg(long, value_name = "ADDR")]
    ipfix: Vec<dpuflow::ir::HostPort>,
    /// Count one packet in N into the IPFIX flow cache, at a random place in each window of
    /// N (RFC 5475 random n-out-of-N; default: the pipeline's `sampling`, else every
    /// packet). Tracked connections still count every packet.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    ipfix_sampling: Option<u32>,
    /// IPFIX Observation Domain ID (default: the pipeline's `observation_domain`, else 1);
    /// instances exporting from one address to one collector need different ones.
    #[arg(long, value_name = "ID")]
    ipfix_domain: Option<u32>,
    /// Path MTU towards the IPFIX collector, in bytes: messages with their IP and UDP
    /// headers fit in it (default: the pipeline's `ipfix_mtu`, else 1500).
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u16).range(i64::from(dpuflow::lang::MIN_IPFIX_MTU)..))]
    ipfix_mtu: Option<u16>,
    /// IPFIX messages sent a second at most, so that many flows expiring at once do not
    /// overflow the collector's receive buffer (default: the pipeline's `ipfix_rate`, else
    /// 10000).
    #[arg(long, value_name = "MSGS", value_parser = clap::value_parser!(u32).range(1..))]
    ipfix_rate: Option<u32>,
    /// Worker threads, 1 to 1024 (default: one per core; with --cpus, one per CPU of the
    /// list after the first, or one per CPU of it where the workers read their own shares
    /// of the live ports).
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    workers: Option<u16>,
    /// The CPUs of the dataplane's threads, as Linux lists them (`2-5,8`): the I/O thread
    /// on the first, the workers on the others in turn; every other thread (metrics,
    /// export, KV-cache clients) on the CPUs the process may use that the list leaves.
    #[arg(long, value_name = "LIST", value_parser = cpu_list)]
    cpus: Option<Box<[usize]>>,
    /// A live port whose interface does not exist yet (a VF representor before the host
    /// makes its VFs) is opened once it does, where it otherwise fails the start;
    /// meanwhile /readyz says not ready.
    #[arg(long)]
    wait_for_interfaces: bool,
    /// The threads that read the live ports and the workers poll without sleeping (live
    /// ports only): no wake-up between a frame's arrival and its processing, at the cost of
    /// a core each kept busy, traffic or not. AF_XDP ports also have the kernel do their
    /// queues' work in the service's calls (preferred busy polling). Meant for cores set
    /// aside with --cpus.
    #[arg(long)]
    busy_poll: bool,
    /// Read the input captures at most this many packets per second (captures only: refused
    /// with live ports).
    #[arg(long, value_name = "PPS", value_parser = clap::value_parser!(u64).range(1..))]
    rate: Option<u64>,
    /// Read the input captures over and over (captures only: refused with live ports).
    #[arg(long = "loop")]
    looping: bool,
    /// Packets per batch passed between the service's threads (the engine runs them 32 at
    /// a time): larger batches spend less on channels and wake-ups.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u16).range(1..=1024))]
    batch: u16,
    /// Log lines as plain text or JSON (on stderr).
    #[arg(long, value_enum, default_value_t = LogFormat::Plain)]
    log_format: LogFormat,
    /// The least severe lines logged. `debug` adds what is routine but worth a look when
    /// something is wrong (a metrics request that failed, a KV-cache client gone, a storage
    /// target still unreachable); nothing is logged per packet at any level.
    #[arg(long, value_enum, default_value_t = LogLevel::Info)]
    log_level: LogLevel,
}

/// A `--cpus` list (boxed: clap takes an argument of type `Vec` for one given many times).
fn cpu_list(text: &str) -> Result<Box<[usize]>, dpuflow::daemon::cpus::CpuListError> {
    dpuflow::daemon::cpus::parse(text).map(Vec::into_boxed_slice)
}

/// `dpuflow bench`'s arguments.
#[derive(clap::Args, Debug)]
struct BenchFlags {
    /// Pipeline file.
    pipeline: PathBuf,
    /// Frame size in bytes (at least the headers the entries need; at most 9216, the
    /// packet buffers' size).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=dpuflow::engine::DEFAULT_MAX_FRAME as i64))]
    size: u16,
    /// Distinct flows, spread over the root pipe's entries.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    flows: u32,
    /// Packets to process.
    #[arg(long, default_value_t = 10_000_000, value_parser = clap::value_parser!(u64).range(1..))]
    packets: u64,
    /// Packets run before timing starts (to fill a connection table, say).
    #[arg(long, default_value_t = 0)]
    warmup: u64,
    /// Keep the IPFIX flow cache, as `dpuflow run --ipfix` does.
    #[arg(long)]
    telemetry: bool,
    /// With --telemetry, count one packet in N into the flow cache, as `dpuflow run
    /// --ipfix-sampling N` does.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    ipfix_sampling: Option<u32>,
    /// The port the traffic arrives on; by default the first port that feeds a root pipe.
    #[arg(long)]
    port: Option<String>,
    /// Make every flow for the root pipe's rule of this name (by default the flows are
    /// spread over all its entries): one path through the pipeline, such as a gateway's
    /// decapsulation without its address-resolution rules.
    #[arg(long, value_name = "NAME", conflicts_with = "trace")]
    rule: Option<String>,
    /// Packets handed to the engine per call (it runs them 32 at a time).
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u16).range(1..=1024))]
    batch: u16,
    /// Write the traffic as a pcap (each flow's frame once, 1 µs apart) and exit, to feed
    /// `dpuflow run` or another tool the same packets.
    #[arg(long, value_name = "FILE")]
    write: Option<PathBuf>,
    /// Take the frames from a ClassBench trace (one per line, IPv4 or IPv6, as `dpuflow acl
    /// gen-trace` writes) instead of synthetic flows: a rule pipe's rates with the packets
    /// its rule set is measured with.
    #[arg(long, value_name = "FILE", conflicts_with = "flows")]
    trace: Option<PathBuf>,
    /// Make the flows TCP connections, both directions arriving on the port: each opens
    /// with a handshake (three packets a flow; a --warmup of three times --flows keeps it
    /// out of the timing), then its client's segments of --size bytes and its server's
    /// acknowledgements alternate, sequence numbers advancing. For connection tracking with
    /// TCP windows; the root pipe's entries must take plain TCP both ways. With --write,
    /// each flow's handshake and one segment with its acknowledgement.
    #[arg(long, conflicts_with = "trace")]
    conversations: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Plain,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogLevel {
    Error,
    Warn,
    Info,
    Debug,
    Trace,
}

impl From<LogLevel> for tracing::Level {
    fn from(l: LogLevel) -> tracing::Level {
        match l {
            LogLevel::Error => tracing::Level::ERROR,
            LogLevel::Warn => tracing::Level::WARN,
            LogLevel::Info => tracing::Level::INFO,
            LogLevel::Debug => tracing::Level::DEBUG,
            LogLevel::Trace => tracing::Level::TRACE,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Human,
    Json,
}

/// Exit statuses shared by the subcommands.
const EXIT_INVALID: u8 = 1;
/// `plan --hardware-only`: a pipe or a rule would run in software.
const EXIT_SOFTWARE: u8 = 3;
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Run(_)) {
        dpuflow::sys::die_on_broken_pipe();
    }
    match cli.command {
        Command::Run(flags) => run(flags),
        Command::Acl { command } => acl(command),
        Command::Kv {
            command: KvCommand::Inspect { file, service },
        } => kv_inspect(&file, service.as_deref()),
        Command::Check { files, format } => check(&files, format),
        Command::Graph { file } => graph(&file),
        Command::Plan {
            file,
            hardware_only,
            calls,
        } => match load(&file) {
            Ok(p) => {
                let plan = dpuflow::doca::plan(&p);
                if calls {
                    let out = std::io::BufWriter::new(std::io::stdout().lock());
                    let mut listing = dpuflow::doca::install::Listing::new(out, &p);
                    if let Err(e) = dpuflow::doca::install(&plan, &p, &mut listing) {
                        eprintln!("{}: {e}", file.display());
                        return ExitCode::FAILURE;
                    }
                } else {
                    print!("{plan}");
                }
                if hardware_only && !(plan.software.is_empty() && plan.software_rules.is_empty()) {
                    eprintln!(
                        "{}: {} of its pipes and {} of its rules would run in software",
                        file.display(),
                        plan.software.len(),
                        plan.software_rules.len()
                    );
                    return ExitCode::from(EXIT_SOFTWARE);
                }
                ExitCode::SUCCESS
            }
            Err(code) => code,
        },
        Command::Replay {
            pipeline,
            inputs,
            outputs,
            batch,
            json,
        } => replay(&pipeline, &inputs, &outputs, batch, json),
        Command::Trace {
            pipeline,
            inputs,
            packet,
        } => trace(&pipeline, &inputs, packet),
        Command::Bench(flags) => bench(flags),
    }
}

/// Checks a pipeline file and returns its program, or prints why not and the exit status.
/// `dpuflow kv inspect`: each KV-cache service's saved index, as its next start would
/// restore it.
fn kv_inspect(file: &Path, only: Option<&str>) -> ExitCode {
    use dpuflow::ir::ServiceKind;
    use dpuflow::kvcache::{persist::Saved, server, storage};
    let program = match load(file) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let services: Vec<_> = program
        .services
        .iter()
        .filter(|s| only.is_none_or(|name| s.name == name))
        .collect();
    if services.is_empty() {
        match only {
            Some(name) => eprintln!("{}: no service `{name}`", file.display()),
            None => eprintln!("{}: no KV-cache service", file.display()),
        }
        return ExitCode::from(EXIT_USAGE);
    }
    let mut failed = false;
    for svc in services {
        let ServiceKind::KvCache(config) = &svc.kind;
        let target = storage::describe_all(&config.targets);
        let inspected = match server::inspect(config) {
            Ok(i) => i,
            Err(e) => {
                eprintln!("kvcache `{}`: {e}", svc.name);
                failed = true;
                continue;
            }
        };
        let sb = match inspected.superblock {
            Ok(sb) => sb,
            Err(why) => {
                println!(
                    "kvcache `{}` on {target}: {why}; its next start is empty",
                    svc.name
                );
                continue;
            }
        };
        let saved = match sb.saved {
            Saved::AtStop => "at a clean stop",
            Saved::Checkpoint => "by a checkpoint",
        };
        println!(
            "kvcache `{}` on {target}: index saved {saved} (layout {})",
            svc.name, sb.version
        );
        let deltas: u64 = sb.deltas.iter().map(|d| d.len).sum();
        println!(
            "  snapshot {} bytes in {} run(s); {} delta(s), {deltas} bytes",
            sb.snapshot.len,
            sb.snapshot.runs.len(),
            sb.deltas.len()
        );
        if let Some(strangers) = inspected.strangers {
            println!("  targets {strangers}");
        }
        match inspected.index {
            Ok(stats) => println!(
                "  {} keys ({} expiring), values in {} of {} blocks of {} bytes",
                stats.keys,
                stats.expiring,
                stats.used_blocks,
                stats.total_blocks,
                config.block_size
            ),
            Err(why) => println!("  {why}; its next start is empty"),
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn load(path: &Path) -> Result<Program, ExitCode> {
    let checked = match lang::check_file(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: error: cannot read file: {e}", path.display());
            return Err(ExitCode::from(EXIT_USAGE));
        }
    };
    eprint!("{}", checked.render());
    checked.program.ok_or(ExitCode::from(EXIT_INVALID))
}

/// The captures `--in` and `--out` bind, then the pipeline's own for ports left unbound;
/// refused when a file would lose data (see [`Bindings::conflict`]).
fn bindings(
    program: &Program,
    inputs: &[String],
    outputs: &[String],
) -> Result<Bindings, ExitCode> {
    let bound = Bindings {
        inputs: bind(program, inputs, "in")?,
        outputs: bind(program, outputs, "out")?,
    }
    .with_pipeline_files(program);
    match bound.conflict(program) {
        Some(why) => {
            eprintln!("error: {why}");
            Err(ExitCode::from(EXIT_USAGE))
        }
        None => Ok(bound),
    }
}

/// Resolves `PORT=FILE` arguments against the program's ports.
fn bind(
    program: &Program,
    args: &[String],
    flag: &str,
) -> Result<Vec<(PortId, PathBuf)>, ExitCode> {
    args.iter()
        .map(|arg| {
            let Some((name, file)) = arg.split_once('=') else {
                eprintln!("error: --{flag} takes PORT=FILE, found `{arg}`");
                return Err(ExitCode::from(EXIT_USAGE));
            };
            match program.ports.iter().position(|p| p.name == name) {
                Some(i) => Ok((PortId(i as u16), PathBuf::from(file))),
                None => {
                    let names: Vec<&str> = program.ports.iter().map(|p| p.name.as_str()).collect();
                    let hint = lang::diag::did_you_mean(name, names.iter().copied())
                        .unwrap_or_else(|| format!("ports: {}", names.join(", ")));
                    eprintln!(
                        "error: --{flag}: pipeline {} has no port `{name}` ({hint})",
                        program.name
                    );
                    Err(ExitCode::from(EXIT_USAGE))
                }
            }
        })
        .collect()
}

fn replay(path: &Path, inputs: &[String], outputs: &[String], batch: u16, json: bool) -> ExitCode {
    let program = match load(path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let bindings = match bindings(&program, inputs, outputs) {
        Ok(b) => b,
        Err(code) => return code,
    };
    if bindings.inputs.is_empty() {
        eprintln!("error: no input: bind one with --in PORT=FILE");
        return ExitCode::from(EXIT_USAGE);
    }
    let mut engine = Engine::new(&program);
    match dpuflow::replay::replay(
        &program,
        &mut engine,
        &bindings,
        usize::from(batch),
        &mut NoObserver,
    ) {
        Ok(report) => {
            if json {
                println!("{}", report.to_json(&program));
            } else {
                print!("{}", report.summary(&program));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn check(files: &[PathBuf], format: Format) -> ExitCode {
    let mut status = ExitCode::SUCCESS;
    let mut unreadable = false;
    for path in files {
        let checked = match lang::check_file(path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{}: error: cannot read file: {e}", path.display());
                unreadable = true;
                continue;
            }
        };
        match format {
            Format::Human => {
                eprint!("{}", checked.render());
                let warnings = checked
                    .diagnostics
                    .iter()
                    .filter(|d| d.severity == Severity::Warning)
                    .count();
                let errors = checked.diagnostics.len() - warnings;
                match &checked.program {
                    Some(p) => println!(
                        "{}: ok: pipeline {}, {} ports, {} pipes, {} rules and entries, {warnings} warnings",
                        path.display(),
                        p.name,
                        p.ports.len(),
                        p.pipes.len(),
                        p.entry_count()
                    ),
                    None => eprintln!("{}: {errors} errors, {warnings} warnings", path.display()),
                }
            }
            Format::Json => {
                for d in &checked.diagnostics {
                    match serde_json::to_string(&checked.sources.json(d)) {
                        Ok(line) => println!("{line}"),
                        Err(e) => eprintln!("error: cannot encode a diagnostic: {e}"),
                    }
                }
            }
        }
        if checked.has_errors() {
            status = ExitCode::from(EXIT_INVALID);
        }
    }
    if unreadable {
        return ExitCode::from(EXIT_USAGE);
    }
    status
}

fn graph(path: &Path) -> ExitCode {
    let checked = match lang::check_file(path) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{}: error: cannot read file: {e}", path.display());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    eprint!("{}", checked.render());
    match &checked.program {
        Some(p) => {
            print!("{}", dpuflow::graph::to_dot(p));
            ExitCode::SUCCESS
        }
        None => ExitCode::from(EXIT_INVALID),
    }
}

fn trace(path: &Path, inputs: &[String], packet: Option<u64>) -> ExitCode {
    let program = match load(path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let inputs = match bind(&program, inputs, "in") {
        Ok(i) => i,
        Err(code) => return code,
    };
    let bindings = Bindings {
        inputs,
        outputs: Vec::new(),
    };
    let mut engine = Engine::new(&program);
    let mut tracer = Tracer::new(&program, packet);
    let result = dpuflow::replay::replay(&program, &mut engine, &bindings, 1, &mut tracer);
    print!("{}", tracer.out);
    match result {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn bench(f: BenchFlags) -> ExitCode {
    let BenchFlags {
        pipeline,
        size,
        flows,
        packets,
        warmup,
        telemetry,
        ipfix_sampling,
        port,
        rule,
        batch,
        write,
        trace,
        conversations,
    } = f;
    let (path, port) = (pipeline.as_path(), port.as_deref());
    let mut program = match load(path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    if let Some(n) = ipfix_sampling {
        program.telemetry.sampling = n;
    }
    let port = match port {
        Some(name) => match bind(&program, &[format!("{name}=")], "port") {
            Ok(b) => b[0].0,
            Err(code) => return code,
        },
        None => match (0..program.ports.len())
            .map(|i| PortId(i as u16))
            .find(|p| program.root_of(*p).is_some())
        {
            Some(p) => p,
            None => {
                eprintln!(
                    "error: no port of pipeline {} feeds a root pipe",
                    program.name
                );
                return ExitCode::from(EXIT_USAGE);
            }
        },
    };
    let size = usize::from(size);
    if conversations {
        let mut traffic = match Conversations::new(&program, port, rule.as_deref(), size, flows) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: {}: {e}", path.display());
                return ExitCode::from(EXIT_USAGE);
            }
        };
        let n = traffic.connections();
        if let Some(out) = write {
            let rounds = dpuflow::traffic::HANDSHAKE_ROUNDS + 2;
            return write_capture(&out, &mut traffic, rounds as usize * n);
        }
        let r = dpuflow::bench::run(
            &program,
            port,
            &mut traffic,
            warmup,
            packets,
            usize::from(batch),
            telemetry,
        );
        return bench_report(&program, port, &r, (n, traffic.max_frame()), batch);
    }
    let frames = match (&trace, &rule) {
        (None, None) => dpuflow::traffic::generate(&program, port, size, flows),
        (None, Some(rule)) => {
            match dpuflow::traffic::generate_for_rule(&program, port, rule, size, flows) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("error: {}: {e}", path.display());
                    return ExitCode::from(EXIT_USAGE);
                }
            }
        }
        (Some(t), _) => match dpuflow::traffic::from_trace(t, size) {
            Ok(f) => f,
            Err(e) => {
                eprintln!("error: {}: {e}", t.display());
                return ExitCode::from(EXIT_USAGE);
            }
        },
    };
    if frames.is_empty() {
        match &trace {
            Some(t) => eprintln!("error: {}: no packets", t.display()),
            None => eprintln!("error: port {} feeds no root pipe", program.port(port).name),
        }
        return ExitCode::from(EXIT_USAGE);
    }
    if let Some(out) = write {
        return write_capture(&out, &mut Cycle::new(&frames), frames.len());
    }
    let r = dpuflow::bench::run(
        &program,
        port,
        &mut Cycle::new(&frames),
        warmup,
        packets,
        usize::from(batch),
        telemetry,
    );
    bench_report(&program, port, &r, (frames.len(), frames[0].len()), batch)
}

/// Writes `count` packets of `traffic` as a pcap, 1 µs apart.
fn write_capture(out: &Path, traffic: &mut impl Source, count: usize) -> ExitCode {
    let mut slot = dpuflow::engine::PacketBuf::new(traffic.max_frame());
    let port = PortId(0);
    let written = dpuflow::io::pcap::CaptureWriter::create(out).and_then(|mut w| {
        for i in 0..count as u64 {
            let ts = 1_000_000_000 + i * 1000;
            traffic.load_next(&mut slot, port, ts);
            w.write(ts, slot.data())?;
        }
        w.finish()
    });
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}: {e}", out.display());
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// Prints what a benchmark of `flows` flows of frames up to `size` bytes measured.
fn bench_report(
    program: &Program,
    port: PortId,
    r: &dpuflow::bench::Report,
    (flows, size): (usize, usize),
    batch: u16,
) -> ExitCode {
    println!(
        "pipeline {}, port {}, {flows} flows, {size}-byte frames, batch {batch}",
        program.name,
        program.port(port).name,
    );
    println!(
        "{} packets in {:.3} s: {:.2} Mpps, {:.1} ns/packet (forwarded {}, dropped {}, queued {})",
        r.packets,
        r.elapsed.as_secs_f64(),
        r.mpps(),
        r.ns_per_packet(),
        r.forwarded,
        r.dropped,
        r.queued
    );
    if let Some((flows, records)) = r.flows {
        println!("flow records: {flows} flows held, {records} records made");
    }
    if let Some(ct) = &r.conntrack {
        // What the traffic made of the table: a benchmark whose packets were all invalid,
        // or all refused, measured something else than it meant to.
        let invalid: u64 = ct.invalid.iter().sum();
        println!(
            "connections: {} tracked, {} created, {} dropped early, {} refused, {invalid} invalid packets",
            ct.entries, ct.inserts, ct.early_drops, ct.drops_full
        );
    }
    ExitCode::SUCCESS
}

/// Prints each packet's rule index, or -1 for no match, a line each.
fn print_classes(classes: impl Iterator<Item = Option<u32>>) -> ExitCode {
    let mut out = String::new();
    for c in classes {
        match c {
            Some(i) => out.push_str(&format!("{i}\n")),
            None => out.push_str("-1\n"),
        }
    }
    print!("{out}");
    ExitCode::SUCCESS
}

fn acl(command: AclCommand) -> ExitCode {
    use dpuflow::firewall::acl;
    let fail = |e: String| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_USAGE)
    };
    match command {
        AclCommand::Classify {
            rules,
            trace,
            ipv6: false,
        } => match (acl::load_rules(&rules), acl::load_trace(&trace)) {
            (Ok(r), Ok(t)) => {
                let c = acl::Classifier::new(&r);
                print_classes(t.iter().map(|k| c.classify(k)))
            }
            (Err(e), _) | (_, Err(e)) => fail(e),
        },
        AclCommand::Classify {
            rules,
            trace,
            ipv6: true,
        } => match (acl::load_rules_v6(&rules), acl::load_trace_v6(&trace)) {
            (Ok(r), Ok(t)) => {
                let c = acl::Classifier::with_space(acl::IPV6_FIVE_TUPLE, &r);
                print_classes(t.iter().map(|k| c.classify(k)))
            }
            (Err(e), _) | (_, Err(e)) => fail(e),
        },
        AclCommand::GenTrace { rules, count, seed } => {
            let rules = match acl::load_rules(&rules) {
                Ok(r) => r,
                Err(e) => return fail(e),
            };
            let mut out = String::with_capacity(count * 40);
            for k in acl::gen_trace(&rules, count, seed) {
                let [s, d, sp, dp, p] = k.0;
                out.push_str(&format!("{s} {d} {sp} {dp} {p}\n"));
            }
            print!("{out}");
            ExitCode::SUCCESS
        }
        AclCommand::Bench {
            rules,
            trace,
            batch,
            iter,
            updates,
            new_rules,
            ipv6: false,
        } => match (acl::load_rules(&rules), acl::load_trace(&trace)) {
            (Ok(r), Ok(t)) => acl_bench(
                acl::FIVE_TUPLE,
                &r,
                &t,
                batch,
                iter,
                updates_of(updates, new_rules),
            ),
            (Err(e), _) | (_, Err(e)) => fail(e),
        },
        AclCommand::Bench {
            rules,
            trace,
            batch,
            iter,
            updates,
            new_rules,
            ipv6: true,
        } => match (acl::load_rules_v6(&rules), acl::load_trace_v6(&trace)) {
            (Ok(r), Ok(t)) => acl_bench(
                acl::IPV6_FIVE_TUPLE,
                &r,
                &t,
                batch,
                iter,
                updates_of(updates, new_rules),
            ),
            (Err(e), _) | (_, Err(e)) => fail(e),
        },
    }
}

/// The updates `acl bench` makes while it looks up: `n` of them, of rules new to the
/// trees with `--new-rules`.
fn updates_of(n: u64, new_rules: bool) -> (u64, dpuflow::bench::AclUpdates) {
    use dpuflow::bench::AclUpdates;
    (
        n,
        if new_rules {
            AclUpdates::NewRules
        } else {
            AclUpdates::Churn
        },
    )
}

/// `dpuflow acl bench` over any key layout.
fn acl_bench<const N: usize>(
    space: dpuflow::firewall::acl::Space<N>,
    rules: &[dpuflow::firewall::acl::Rule<N>],
    trace: &[dpuflow::firewall::acl::Key<N>],
    batch: usize,
    iter: u32,
    updates: (u64, dpuflow::bench::AclUpdates),
) -> ExitCode {
    let start = std::time::Instant::now();
    let c = dpuflow::firewall::acl::Classifier::with_space(space, rules);
    let build = start.elapsed();
    println!(
        "rules {}, {} trees, build {:.1} ms, memory {:.2} MiB, {} rules hide others in covered regions",
        rules.len(),
        c.trees(),
        build.as_secs_f64() * 1e3,
        c.memory_bytes() as f64 / (1 << 20) as f64,
        c.covering_rules()
    );
    println!(
        "trees (depth, nodes, rule copies in leaves): {:?}",
        c.tree_shapes()
    );
    let r = dpuflow::bench::acl(&c, rules, trace, batch, iter, updates);
    println!(
        "lookups: {} in {:.3} s: {:.2} Mpps (batch {batch}, {} matched)",
        r.lookups,
        r.elapsed.as_secs_f64(),
        r.lookups as f64 / r.elapsed.as_secs_f64() / 1e6,
        r.matched
    );
    if updates.0 > 0 {
        println!(
            "updates (second thread, while the lookups ran): {} in {:.3} s: {:.0}/s ({:.2} M/s)",
            r.updates,
            r.update_time.as_secs_f64(),
            r.updates as f64 / r.update_time.as_secs_f64(),
            r.updates as f64 / r.update_time.as_secs_f64() / 1e6
        );
    }
    ExitCode::SUCCESS
}

fn run(f: RunFlags) -> ExitCode {
    let path = f.pipeline.as_path();
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_max_level(tracing::Level::from(f.log_level))
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match f.log_format {
        LogFormat::Plain => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    let started = std::time::Instant::now();
    let mut program = match load(path) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let pipeline = dpuflow::daemon::PipelineFile {
        path: f.pipeline.clone(),
        telemetry: dpuflow::daemon::TelemetryFlags {
            sampling: f.ipfix_sampling,
            observation_domain: f.ipfix_domain,
            ipfix_mtu: f.ipfix_mtu,
            ipfix_rate: f.ipfix_rate,
        },
    };
    pipeline.telemetry.apply(&mut program.telemetry);
    let collectors = if f.ipfix.is_empty() {
        program.telemetry.ipfix.clone()
    } else {
        f.ipfix
    };
    if program.telemetry.sampling > 1 && collectors.is_empty() {
        tracing::warn!("IPFIX sampling is set but no collector is: nothing is exported");
    }
    let mut ipfix = Vec::new();
    for collector in collectors {
        let address = match collector.resolve() {
            Ok(address) => address,
            Err(e) => {
                tracing::error!(%collector, error = %e, "cannot resolve the IPFIX collector");
                return ExitCode::from(EXIT_USAGE);
            }
        };
        let named = collector.host.parse::<std::net::IpAddr>().is_err();
        if named {
            tracing::info!(%collector, %address, "IPFIX collector resolved");
        }
        ipfix.push(dpuflow::telemetry::collector::Destination {
            address,
            name: named.then_some(collector),
        });
    }
    let load_seconds = started.elapsed().as_secs_f64();
    let bindings = match bindings(&program, &f.inputs, &f.outputs) {
        Ok(b) => b,
        Err(code) => return code,
    };
    let default_metrics = std::net::SocketAddr::from(([127, 0, 0, 1], 9464));
    let opts = dpuflow::daemon::Options {
        pipeline,
        bindings,
        metrics: Some(
            f.metrics
                .or(program.telemetry.prometheus)
                .unwrap_or(default_metrics),
        ),
        ipfix,
        workers: f.workers.map(usize::from),
        cpus: f.cpus.map(Vec::from),
        rate: f.rate,
        looping: f.looping,
        batch: usize::from(f.batch),
        wait_for_interfaces: f.wait_for_interfaces,
        busy_poll: f.busy_poll,
    };
    match dpuflow::daemon::run(program, load_seconds, opts) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "dpuflow run failed");
            ExitCode::from(EXIT_USAGE)
        }
    }
}
