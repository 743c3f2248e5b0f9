//! The packet path allocates nothing once it is warm: every example and benchmark pipeline,
//! from every port that feeds a root pipe, runs batches of synthetic traffic with flow
//! records off, exact and sampled, and a counting allocator watches the thread running
//! them. Connection tables, flow caches and record buffers are sized up front; what the
//! warmup may allocate (a flow cache's index growing with its first flows) happens before
//! the count starts. The steady phase spaces packets 2 ms apart, so over its 200 seconds
//! flows reach their active timeout and the sweeps make records as the service's workers
//! do.

mod counting;

use dpuflow::engine::{Engine, NoObserver, PacketBuf};
use dpuflow::ir::{PortId, Program};
use dpuflow::traffic::{Conversations, Cycle, Source};
use std::cell::Cell;
use std::path::Path;

thread_local! {
    /// Whether this thread's allocations are counted, and how many were.
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

#[global_allocator]
static ALLOCATOR: counting::Counting = counting::Counting(note_allocation);

/// Counts an allocation of this thread while it counts.
fn note_allocation() {
    // `try_with`: a thread being torn down has no cells left, and is not counted.
    let _ = COUNTING.try_with(|c| {
        if c.get() {
            let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        }
    });
}

/// How many allocations `f` made on this thread.
fn allocations_in(f: impl FnOnce()) -> u64 {
    ALLOCATIONS.with(|n| n.set(0));
    COUNTING.with(|c| c.set(true));
    f();
    COUNTING.with(|c| c.set(false));
    ALLOCATIONS.with(Cell::get)
}

/// The flow records a run keeps.
#[derive(Debug, Clone, Copy)]
enum Records {
    Off,
    Exact,
    /// One packet in this many.
    Sampled(u32),
}

const WARMUP_PACKETS: u64 = 25_000;
const COUNTED_PACKETS: u64 = 100_000;

/// Runs `traffic` into a fresh engine for `program` on `port`; the allocations of the
/// counted phase.
fn steady_allocations(
    program: &Program,
    port: PortId,
    traffic: &mut dyn Source,
    records: Records,
) -> u64 {
    let mut program = program.clone();
    let mut engine = Engine::new(&program);
    match records {
        Records::Off => {}
        Records::Exact => engine.enable_flows(&program.telemetry),
        Records::Sampled(n) => {
            program.telemetry.sampling = n;
            engine.enable_flows(&program.telemetry);
        }
    }
    let mut slots: Vec<PacketBuf> = (0..32)
        .map(|_| PacketBuf::new(traffic.max_frame()))
        .collect();
    // Taken out as the service's worker takes them, into room it has already.
    let mut taken = Vec::with_capacity(1 << 20);
    let mut ts = 1_000_000_000u64;
    let mut run = |packets: u64, gap_ns: u64, taken: &mut Vec<_>| {
        for _ in 0..packets / 32 {
            traffic.load_batch(&mut slots, port, ts, gap_ns);
            ts += 32 * gap_ns;
            engine.process(&mut slots, &mut NoObserver);
            engine.take_flow_records(taken);
            taken.clear();
        }
    };
    run(WARMUP_PACKETS, 100, &mut taken);
    allocations_in(|| run(COUNTED_PACKETS, 2_000_000, &mut taken))
}

fn program(path: &str) -> Program {
    let checked = dpuflow::lang::check_file(Path::new(path)).expect("readable pipeline");
    assert!(!checked.has_errors(), "{path}:\n{}", checked.render());
    checked.program.expect("a program")
}

/// The ports of `program` that feed a root pipe.
fn root_ports(program: &Program) -> Vec<PortId> {
    (0..program.ports.len())
        .map(|i| PortId(i as u16))
        .filter(|p| program.root_of(*p).is_some())
        .collect()
}

const RECORDS: [Records; 3] = [Records::Off, Records::Exact, Records::Sampled(100)];

#[test]
fn no_pipeline_allocates_per_packet() {
    let mut paths: Vec<String> = ["pipelines", "bench", "tests/data"]
        .iter()
        .flat_map(|dir| std::fs::read_dir(dir).expect("directory"))
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "pipe"))
        .map(|p| p.display().to_string())
        .collect();
    paths.sort();
    let mut ran = 0;
    let mut failed = Vec::new();
    for path in &paths {
        let program = program(path);
        for port in root_ports(&program) {
            let frames = dpuflow::traffic::generate(&program, port, 64, 1024);
            if frames.is_empty() {
                continue;
            }
            for records in RECORDS {
                let n = steady_allocations(&program, port, &mut Cycle::new(&frames), records);
                ran += 1;
                if n > 0 {
                    let name = &program.port(port).name;
                    failed.push(format!("{path} port {name}, records {records:?}: {n}"));
                }
            }
        }
    }
    assert!(ran >= 30, "only {ran} runs: the pipelines were not found");
    assert!(
        failed.is_empty(),
        "allocations in the steady phase:\n{}",
        failed.join("\n")
    );
}

/// Connections opened by handshakes and then carrying data both ways, the traffic that
/// keeps a stateful firewall's connection table busy.
#[test]
fn connections_allocate_nothing_per_packet() {
    for path in [
        "bench/conversations.pipe",
        "bench/conversations-window.pipe",
    ] {
        let program = program(path);
        let port = root_ports(&program)[0];
        for records in RECORDS {
            let mut traffic = Conversations::new(&program, port, None, 64, 1024).expect("traffic");
            let n = steady_allocations(&program, port, &mut traffic, records);
            assert_eq!(n, 0, "{path}, records {records:?}");
        }
    }
}
