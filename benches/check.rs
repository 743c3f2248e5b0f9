//! `check` of pipelines importing the 10k-rule ClassBench sets from ../shared/classbench:
//! parse, lower, shadowing analysis. Run with `cargo bench --bench check`.

use criterion::{criterion_group, criterion_main, Criterion};
use std::path::Path;

fn pipeline_for(set: &str) -> String {
    format!(
        "pipeline acl\nport inside {{ driver pcap }}\nport outside {{ driver pcap }}\n\
         pipe acl root from inside {{\n    rules from \"{set}\" {{ actions fwd outside }}\n    default {{ actions drop }}\n}}\n"
    )
}

fn check(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/classbench");
    assert!(
        dir.join("acl1_10k").exists(),
        "ClassBench sets not found in {}",
        dir.display()
    );
    let mut group = c.benchmark_group("check");
    group.sample_size(20);
    for set in ["acl1_10k", "fw1_10k", "ipc1_10k"] {
        let text = pipeline_for(set);
        group.bench_function(set, |b| {
            b.iter(|| {
                let checked = dpuflow::lang::check_source("bench.pipe", &text, &dir);
                assert!(checked.program.is_some());
                checked
            })
        });
    }
    group.finish();
}

criterion_group!(benches, check);
criterion_main!(benches);
