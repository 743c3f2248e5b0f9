//! Runs of frames through the shipped pipelines, in order and with time passing, with
//! flow records on: whatever the bytes, no panic; every forwarded frame parses (all but a
//! tunnel inside it); the records of the flows seen are exported in messages under the MTU.
//!
//! Input: a byte choosing the pipeline, then frames, each as its port (one byte), the
//! milliseconds since the one before (one byte), its length (two bytes, big-endian; the
//! top bit set: its checksums are filled in first, so that pipelines verifying them take
//! it further) and its bytes. A frame whose port is 255 reloads the pipeline its second
//! byte chooses instead, where a running service could (the same ports, services and
//! telemetry), connections and flows kept.
#![no_main]

use dpuflow::daemon::restart_needed;
use dpuflow::engine::parse::parse;
use dpuflow::engine::{Compiled, DropReason, Engine, NoObserver, PacketBuf, Renumbering, Verdict};
use dpuflow::ir::{PortId, Program};
use dpuflow::telemetry::ipfix::Exporter;
use dpuflow::wire::checksum::{checksum, fold, pseudo_v4, pseudo_v6, sum};
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
        let (p, code) = &programs[usize::from(which) % programs.len()];
        (p, code)
    };
    let mut engine = Engine::sharing(Arc::clone(code));
    engine.enable_flows(&p.telemetry);
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
            fill_checksums(&mut filled);
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
        // whatever it carries.
        if let Verdict::Forward(_) = pkt.verdict {
            match parse(pkt.data(), code.tunnels()) {
                Ok(_) | Err(DropReason::TunnelMalformed) => {}
                Err(e) => panic!("a forwarded frame does not parse: {e:?}"),
            }
        }
    }
    let mut records = Vec::new();
    engine.take_flow_records(&mut records);
    engine.flush_flows(now + 1, &mut records);
    let mut exporter = Exporter::new(1, 1472, 600, p.telemetry.sampling);
    exporter.messages(&records, now / 1_000_000_000, &mut |m| {
        assert!(m.len() <= 1472)
    });
});

/// Fills in an Ethernet frame's IPv4 header checksum and, for a packet that is not a
/// later fragment, its TCP, UDP, ICMP or ICMPv6 checksum over what its IP length covers
/// (RFC 791, RFC 9293 §3.1, RFC 768, RFC 792, RFC 4443 §2.3); anything else is left.
fn fill_checksums(f: &mut [u8]) {
    let be16 = |f: &[u8], at: usize| f.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    let mut at = 12;
    while matches!(be16(f, at), Some(0x8100 | 0x88a8)) {
        at += 4;
    }
    let l3 = at + 2;
    match be16(f, at) {
        Some(0x0800) if f.len() >= l3 + 20 => {
            let ihl = usize::from(f[l3] & 0x0f) * 4;
            if ihl < 20 || f.len() < l3 + ihl {
                return;
            }
            f[l3 + 10..l3 + 12].fill(0);
            let c = checksum(&f[l3..l3 + ihl]);
            f[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
            let end = (l3 + usize::from(be16(f, l3 + 2).unwrap_or(0))).min(f.len());
            let later_fragment = be16(f, l3 + 6).unwrap_or(0) & 0x1fff != 0;
            if end < l3 + ihl || later_fragment {
                return;
            }
            let proto = f[l3 + 9];
            let src = [f[l3 + 12], f[l3 + 13], f[l3 + 14], f[l3 + 15]];
            let dst = [f[l3 + 16], f[l3 + 17], f[l3 + 18], f[l3 + 19]];
            let len = (end - l3 - ihl) as u16;
            let pseudo = if proto == 1 {
                0
            } else {
                pseudo_v4(src, dst, proto, len)
            };
            fill_transport(&mut f[l3 + ihl..end], proto, pseudo);
        }
        Some(0x86dd) if f.len() >= l3 + 40 => {
            let end = (l3 + 40 + usize::from(be16(f, l3 + 4).unwrap_or(0))).min(f.len());
            let proto = f[l3 + 6];
            let mut src = [0; 16];
            src.copy_from_slice(&f[l3 + 8..l3 + 24]);
            let mut dst = [0; 16];
            dst.copy_from_slice(&f[l3 + 24..l3 + 40]);
            let pseudo = pseudo_v6(&src, &dst, proto, (end - l3 - 40) as u32);
            fill_transport(&mut f[l3 + 40..end], proto, pseudo);
        }
        _ => {}
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
