//! The service allocates nothing per packet or per batch: `dpuflow run`'s threads (the one
//! reading captures, the worker, the IPFIX exporter) loop a capture of the benchmark's
//! traffic with flow records exported, and an allocator counting every thread's
//! allocations watches two seconds of it once it is warm. What is left is the records'
//! hand-off to the exporter, once a second (4 to 7 allocations in the two seconds), where one
//! a batch would be a hundred thousand.
//!
//! Its own test binary: the count is of the whole process, and the service stops on the
//! SIGTERM the test sends the process.

mod common;
mod counting;

use dpuflow::daemon::{self, Options};
use dpuflow::ir::{PortId, Program};
use dpuflow::replay::Bindings;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting(note_allocation);

/// Counts an allocation of any thread while [`COUNTING`] is set.
fn note_allocation() {
    if COUNTING.load(Relaxed) {
        ALLOCATIONS.fetch_add(1, Relaxed);
    }
}

fn program(path: &str) -> Program {
    let checked = dpuflow::lang::check_file(Path::new(path)).expect("readable pipeline");
    assert!(!checked.has_errors(), "{path}:\n{}", checked.render());
    checked.program.expect("a program")
}

/// A capture of one packet of each of `flows` flows arriving on `port`, 1 µs apart.
fn capture(program: &Program, port: PortId, flows: u32, path: &Path) {
    let frames = dpuflow::traffic::generate(program, port, 64, flows);
    let mut w = dpuflow::io::pcap::CaptureWriter::create(path).expect("capture created");
    for (i, f) in frames.iter().enumerate() {
        w.write(1_000_000_000 + i as u64 * 1000, f)
            .expect("frame written");
    }
    w.finish().expect("capture written");
}

/// Loops of the capture to see before watching: the service's start (which allocates
/// ~1,400 times, and on a loaded machine can take seconds: its tables are written whole)
/// is over by then.
const LOOPS_FIRST: u64 = 3;
/// Flows in the capture, a packet each.
const FLOWS: u32 = 4096;
/// Then a while longer, for the once-a-second work to have run once.
const WARM: Duration = Duration::from_millis(1500);
const WATCHED: Duration = Duration::from_secs(2);
/// Allocations allowed in [`WATCHED`]: the exporter's hand-offs (see the file's comment),
/// with room to spare.
const MOST: u64 = 40;

#[test]
fn a_looping_service_exporting_flows_allocates_nothing_per_packet() {
    let path = "pipelines/vxlan-gateway.pipe";
    let program = program(path);
    let port = PortId(
        program
            .ports
            .iter()
            .position(|p| p.name == "host")
            .expect("port host") as u16,
    );
    let dir = std::env::temp_dir().join(format!("dpuflow-service-alloc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let input: PathBuf = dir.join("host.pcap");
    capture(&program, port, FLOWS, &input);
    // The export goes to a socket nobody reads: its sends succeed until its buffer fills,
    // then fail, counted, as with a collector that has gone.
    let sink = std::net::UdpSocket::bind("127.0.0.1:0").expect("sink");
    let collector = sink.local_addr().expect("sink address");
    let metrics: std::net::SocketAddr = format!("127.0.0.1:{}", common::free_port())
        .parse()
        .expect("address");
    let opts = Options {
        pipeline: daemon::PipelineFile {
            path: PathBuf::from(path),
            telemetry: Default::default(),
        },
        bindings: Bindings {
            inputs: vec![(port, input)],
            outputs: vec![],
        },
        metrics: Some(metrics),
        ipfix: vec![dpuflow::telemetry::collector::Destination {
            address: collector,
            name: None,
        }],
        workers: Some(1),
        cpus: None,
        rate: None,
        looping: true,
        batch: 256,
        wait_for_interfaces: false,
        busy_poll: false,
    };
    let service = std::thread::spawn(move || daemon::run(program, 0.0, opts));
    let received = "dpuflow_port_received_packets_total{port=\"host\"}";
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while common::get(metrics, "/metrics")
        .and_then(|(_, body)| common::metric(&body, received))
        .is_none_or(|n| n < LOOPS_FIRST * u64::from(FLOWS))
    {
        assert!(!service.is_finished(), "the service stopped early");
        assert!(
            std::time::Instant::now() < deadline,
            "the service looped its capture fewer than {LOOPS_FIRST} times in a minute"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(WARM);
    assert!(!service.is_finished(), "the service stopped early");
    COUNTING.store(true, Relaxed);
    std::thread::sleep(WATCHED);
    COUNTING.store(false, Relaxed);
    let allocations = ALLOCATIONS.load(Relaxed);
    // A signal to this process, which the service's handler turns into a graceful stop.
    let me = std::process::id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &me])
        .status()
        .expect("kill runs");
    assert!(killed.success());
    let stopped = service.join().expect("service thread");
    assert!(stopped.is_ok(), "{stopped:?}");
    std::fs::remove_dir_all(&dir).expect("scratch removed");
    assert!(
        allocations <= MOST,
        "{allocations} allocations in {WATCHED:?} of steady looping (at most {MOST})"
    );
}
