//! A meter alone (one engine), shared by workers with no one else drawing on it, and
//! shared with another thread marking against it at the same time: a batch of 32
//! packets through a pipe that meters every packet, for a meter with room for all of
//! them (green) and one far over its rate (red). Run with `cargo bench --bench meters`.

use criterion::{criterion_group, criterion_main, Criterion};
use dpuflow::engine::{Compiled, Engine, NoObserver, PacketBuf, DEFAULT_MAX_FRAME};
use dpuflow::ir::PortId;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The pipeline, compiled, with a meter of `rate`.
fn compiled(rate: &str) -> Arc<Compiled> {
    let text = format!(
        "pipeline m\nport a {{ driver pcap }}\nport b {{ driver pcap }}\n\
         meter m {{ rate {rate}  burst 10000 }}\n\
         pipe all root from a {{\n    rule all {{ actions meter m, fwd b }}\n    default {{ actions drop }}\n}}\n"
    );
    let checked = dpuflow::lang::check_source("m.pipe", &text, Path::new("."));
    Arc::new(Compiled::new(&checked.program.expect("pipeline")))
}

/// A UDP frame (Ethernet, IPv4, UDP, 18 bytes of payload: 64 bytes).
fn frame() -> Vec<u8> {
    let mut f = vec![0u8; 64];
    f[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
    f[14] = 0x45;
    f[16..18].copy_from_slice(&50u16.to_be_bytes());
    f[22] = 64;
    f[23] = 17;
    f[26..30].copy_from_slice(&[10, 0, 0, 1]);
    f[30..34].copy_from_slice(&[10, 0, 0, 2]);
    f[34..36].copy_from_slice(&1024u16.to_be_bytes());
    f[36..38].copy_from_slice(&5001u16.to_be_bytes());
    f[38..40].copy_from_slice(&30u16.to_be_bytes());
    f
}

/// Loads 32-packet batches, 10 ns of packet time apart, and runs them through `e`.
fn run(c: &mut Criterion, name: &str, mut e: Engine) {
    let f = frame();
    let mut batch: Vec<PacketBuf> = (0..32).map(|_| PacketBuf::new(DEFAULT_MAX_FRAME)).collect();
    let mut now = 1_000_000_000u64;
    c.bench_function(name, |b| {
        b.iter(|| {
            for p in batch.iter_mut() {
                now += 10;
                p.load(&f, PortId(0), now);
            }
            e.process(&mut batch, &mut NoObserver);
        })
    });
}

fn meters(c: &mut Criterion) {
    for (colour, rate) in [("green", "1000000000 pps"), ("red", "1000 pps")] {
        let code = compiled(rate);
        run(
            c,
            &format!("meter {colour}, alone"),
            Engine::sharing(Arc::clone(&code)),
        );
        let buckets = code.shared_meters();
        let worker = || {
            let mut e = Engine::sharing(Arc::clone(&code));
            e.share_meters(&buckets, 2);
            e
        };
        run(c, &format!("meter {colour}, shared"), worker());
        // A second worker marking against the same buckets all the while.
        let (mine, mut other) = (worker(), worker());
        let stop = Arc::new(AtomicBool::new(false));
        let rival = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let f = frame();
                let mut batch: Vec<PacketBuf> =
                    (0..32).map(|_| PacketBuf::new(DEFAULT_MAX_FRAME)).collect();
                let mut now = 1_000_000_000u64;
                while !stop.load(Ordering::Relaxed) {
                    for p in batch.iter_mut() {
                        now += 10;
                        p.load(&f, PortId(0), now);
                    }
                    other.process(&mut batch, &mut NoObserver);
                }
            })
        };
        run(
            c,
            &format!("meter {colour}, shared with a busy worker"),
            mine,
        );
        stop.store(true, Ordering::Relaxed);
        rival.join().expect("rival worker");
    }
}

criterion_group!(benches, meters);
criterion_main!(benches);
