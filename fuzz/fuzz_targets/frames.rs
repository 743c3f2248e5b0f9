//! Runs of frames through the shipped pipelines, in order and with time passing, with
//! flow records on: whatever the bytes, no panic; every forwarded frame parses (all but a
//! tunnel inside it); the records of the flows seen are exported in messages under the MTU.
//!
//! Input: a byte choosing the pipeline (its top bit set: the flow cache samples one packet
//! in three), then frames, each as its port (one byte), the
//! milliseconds since the one before (one byte), its length (two bytes, big-endian; the
//! top bit set: its checksums are filled in first, so that pipelines verifying them take
//! it further) and its bytes. A frame whose port is 255 reloads the pipeline its second
//! byte chooses instead, where a running service could (the same ports, services and
//! telemetry), connections and flows kept.
#![no_main]

use dpuflow::daemon::restart_needed;
use dpuflow::engine::parse::{parse, pseudo_header, Meta, TunnelPorts, L3};
use dpuflow::engine::{Compiled, DropReason, Engine, NoObserver, PacketBuf, Renumbering};
use dpuflow::ir::{PortId, Program};
use dpuflow::telemetry::ipfix::Exporter;
use dpuflow::wire::checksum::{checksum, fold, sum};
use libfuzzer_sys::fuzz_target;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// The example pipelines, the tests' and the benchmarks': between them every kind of
/// table, action and connection tracking option.
const DIRS: &[&str] = &["pipelines", "tests/data", "bench"];

/// The port byte that makes a frame a reload.
const RELOAD: u8 = 255;

/// The length's bit that has the frame's checksums filled in.
const FILL_CHECKSUMS: u16 = 0x8000;

/// Each pipeline that checks (one reading ClassBench rules from outside the repository
/// may not, on another machine), compiled once.
fn programs() -> &'static [(Program, Arc<Compiled>)] {
    static PROGRAMS: OnceLock<Vec<(Program, Arc<Compiled>)>> = OnceLock::new();
    PROGRAMS.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        // In a fixed order, so that an input picks the same pipeline on every machine.
        let files: Vec<_> = DIRS
            .iter()
            .flat_map(|d| {
                let mut in_dir: Vec<_> = std::fs::read_dir(root.join(d))
                    .expect("read a pipeline folder")
                    .map(|e| e.expect("a folder entry").path())
                    .filter(|p| p.extension().is_some_and(|x| x == "pipe"))
                    .collect();
                in_dir.sort();
                in_dir
            })
            .collect();
        let programs: Vec<_> = files
            .iter()
            .filter_map(|f| dpuflow::lang::check_file(f).ok()?.program)
            .map(|mut p| {
                if let Some(ct) = &mut p.conntrack {
                    ct.capacity = 1024;
                }
                let code = Arc::new(Compiled::new(&p));
                (p, code)
            })
            .collect();
        let reloads = programs
            .iter()
            .flat_map(|(a, _)| programs.iter().map(move |(b, _)| (a, b)))
            .filter(|(a, b)| a.name != b.name && restart_needed(a, b).is_empty())
            .count();
        eprintln!(
            "{} of {} pipelines checked; {reloads} ordered pairs can reload",
            programs.len(),
            files.len()
        );
        programs
    })
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&which, mut rest)) = bytes.split_first() else {
        return;
    };
    let programs = programs();
    let (mut p, mut code) = {
        let (p, code) = &programs[usize::from(which & 0x7f) % programs.len()];
        (p, code)
    };
    let mut telemetry = p.telemetry.clone();
    // A small cache, written whole for each input (and filled by a few hundred frames).
    telemetry.flow_cache = 256;
    if which & 0x80 != 0 {
        telemetry.sampling = 3;
    }
    let mut engine = Engine::sharing(Arc::clone(code));
    engine.enable_flows(&telemetry);
    let mut pkt = PacketBuf::new(9216);
    let mut now = 1_000_000_000u64;
    let mut filled = Vec::new();
    while let [port, gap, len_hi, len_lo, more @ ..] = rest {
        let len = u16::from_be_bytes([*len_hi, *len_lo]);
        let n = usize::from(len & !FILL_CHECKSUMS).min(more.len());
        let (mut frame, after) = more.split_at(n);
        rest = after;
        if len & FILL_CHECKSUMS != 0 {
            filled.clear();
            filled.extend_from_slice(frame);
            fill_checksums(&mut filled, code.tunnels());
            frame = &filled;
        }
        if *port == RELOAD {
            // As SIGHUP does, where the service would take the other pipeline.
            let (next, next_code) = &programs[usize::from(*gap) % programs.len()];
            if restart_needed(p, next).is_empty() {
                engine.reload(Arc::clone(next_code), &Renumbering::between(p, next));
                (p, code) = (next, next_code);
            }
            continue;
        }
        now += u64::from(*gap) * 1_000_000;
        engine.advance(now);
        let port = PortId(u16::from(*port) % p.ports.len() as u16);
        if !pkt.load(frame, port, now) {
            continue;
        }
        engine.process(std::slice::from_mut(&mut pkt), &mut NoObserver);
        // What a pipeline forwards was parsed whole, and whatever it did (rewrites,
        // encapsulation, decapsulation) leaves a frame that parses whole again; all but
        // a tunnel inside it: a decapsulated frame may itself be UDP to a tunnel port,
        // whatever it carries. So does the ICMP error answering one too big to send.
        if pkt.verdict.sent_to().is_some() {
            match parse(pkt.data(), code.tunnels()) {
                Ok(_) | Err(DropReason::TunnelMalformed) => {}
                Err(e) => panic!("a forwarded frame does not parse: {e:?}"),
            }
        }
    }
    let mut records = Vec::new();
    engine.take_flow_records(&mut records);
    engine.flush_flows(now + 1, &mut records);
    let mut exporter = Exporter::new(1, 1472, 600, telemetry.sampling);
    exporter.messages(&records, now / 1_000_000_000, &mut |m| {
        assert!(m.len() <= 1472)
    });
});

/// Fills in the IPv4 header checksum of a frame the parser takes and, for a packet that is
/// not a fragment, its TCP, UDP, ICMP or ICMPv6 checksum over what its IP length covers
/// (RFC 791, RFC 9293 §3.1, RFC 768, RFC 792, RFC 4443 §2.3); anything else is left.
fn fill_checksums(f: &mut [u8], tunnels: &TunnelPorts) {
    let Ok(Meta { outer: l, .. }) = parse(f, tunnels) else {
        return;
    };
    let (l3, l4, end) = (usize::from(l.l3), usize::from(l.l4), usize::from(l.l3_end));
    if l.l3_kind == L3::V4 {
        f[l3 + 10..l3 + 12].fill(0);
        let c = checksum(&f[l3..l4]);
        f[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
    }
    if l.fragment || end < l4 {
        return;
    }
    // ICMP's checksum covers its message alone.
    let pseudo = match l.proto {
        1 => Some(0),
        proto => pseudo_header(f, &l, proto, end - l4),
    };
    if let Some(pseudo) = pseudo {
        fill_transport(&mut f[l4..end], l.proto, pseudo);
    }
}

/// Fills in the checksum of transport header and payload `l4` of protocol `proto`, whose
/// pseudo-header sums to `pseudo`.
fn fill_transport(l4: &mut [u8], proto: u8, pseudo: u32) {
    let at = match proto {
        6 => 16,
        17 => 6,
        1 | 58 => 2,
        _ => return,
    };
    if l4.len() < at + 2 {
        return;
    }
    l4[at..at + 2].fill(0);
    let mut c = !fold(sum(pseudo, l4));
    // UDP sends a computed zero as all ones: zero says none was computed.
    if proto == 17 && c == 0 {
        c = 0xffff;
    }
    l4[at..at + 2].copy_from_slice(&c.to_be_bytes());
}
