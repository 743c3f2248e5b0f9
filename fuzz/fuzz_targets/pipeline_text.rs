//! Any text given to the checker: diagnostics, never a panic. Whatever it accepts compiles
//! for the software engine and plans for DOCA, and every call of the plan can be written.
#![no_main]

use dpuflow::engine::Engine;
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|bytes: &[u8]| {
    let base = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../pipelines"));
    let checked = dpuflow::lang::check_bytes("fuzz.pipe", bytes, base);
    let _ = checked.render();
    for d in &checked.diagnostics {
        let _ = checked.sources.json(d);
    }
    assert_eq!(checked.program.is_some(), !checked.has_errors());
    if let Some(mut p) = checked.program {
        if let Some(ct) = &mut p.conntrack {
            ct.capacity = ct.capacity.min(1024);
        }
        let plan = dpuflow::doca::plan(&p);
        let _ = plan.to_string();
        let mut calls = dpuflow::doca::install::Listing::new(std::io::sink(), &p);
        dpuflow::doca::install(&plan, &p, &mut calls).expect("a checked program installs");
        let _ = Engine::new(&p);
    }
});
