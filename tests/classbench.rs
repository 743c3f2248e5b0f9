//! `rules from` with the ClassBench rule sets in ../shared/classbench: every line becomes
//! a rule, in order, with the fields DPDK's ACL reads.

use dpuflow::ir::{FieldId, Pattern, PipeBody};
use dpuflow::lang;
use std::path::{Path, PathBuf};

fn classbench_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/classbench");
    assert!(
        dir.join("acl1_1k").exists(),
        "ClassBench sets must be in {} (the project's shared folder)",
        dir.display()
    );
    dir
}

fn pipeline(set: &str) -> String {
    format!(
        "pipeline acl\nport inside {{ driver pcap }}\nport outside {{ driver pcap }}\n\
         pipe acl root from inside {{\n    rules from \"{set}\" {{ actions count, fwd outside }}\n    default {{ actions drop }}\n}}\n"
    )
}

#[test]
fn every_set_loads_line_for_line() {
    let dir = classbench_dir();
    for set in [
        "acl1_1k", "fw1_1k", "ipc1_1k", "acl1_10k", "fw1_10k", "ipc1_10k",
    ] {
        let lines = std::fs::read_to_string(dir.join(set))
            .expect("read")
            .lines()
            .filter(|l| !l.trim().is_empty())
            .count();
        let checked = lang::check_source("acl.pipe", &pipeline(set), &dir);
        assert!(!checked.has_errors(), "{set}:\n{}", checked.render());
        let program = checked.program.expect("program");
        let PipeBody::Rules(rules) = &program.pipes[0].body else {
            panic!("rules pipe")
        };
        assert_eq!(rules.len(), lines, "{set}");
        assert_eq!(rules[0].name, format!("{set}:1"));
    }
}

#[test]
fn first_acl_rule_is_lowered_exactly() {
    // @176.19.181.33/32  90.145.23.162/32  0 : 65535  1550 : 1550  0x06/0xFF
    let dir = classbench_dir();
    let program = lang::check_source("acl.pipe", &pipeline("acl1_1k"), &dir)
        .program
        .expect("valid");
    let PipeBody::Rules(rules) = &program.pipes[0].body else {
        panic!()
    };
    let got: Vec<(FieldId, Pattern)> = rules[0]
        .matches
        .iter()
        .map(|m| (m.field.id, m.pattern.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (
                FieldId::Ipv4Src,
                Pattern::Masked {
                    value: 0xb013_b521,
                    mask: 0xffff_ffff
                }
            ),
            (
                FieldId::Ipv4Dst,
                Pattern::Masked {
                    value: 0x5a91_17a2,
                    mask: 0xffff_ffff
                }
            ),
            (
                FieldId::IpProto,
                Pattern::Masked {
                    value: 6,
                    mask: 0xff
                }
            ),
            (FieldId::L4Dst, Pattern::Range { lo: 1550, hi: 1550 }),
        ]
    );
}

#[test]
fn rule_file_errors_name_the_file_and_line() {
    let dir = tempdir();
    std::fs::write(
        dir.join("bad.rules"),
        "@1.2.3.4/32\t5.6.7.8/32\t0 : 65535\t80 : 80\t0x06/0xFF\n@1.2.3.4/32 junk\n",
    )
    .expect("write");
    let checked = lang::check_source("acl.pipe", &pipeline("bad.rules"), &dir);
    let text = checked.render();
    assert!(
        text.contains(&format!(
            "{}:2:1: error: malformed ClassBench rule",
            dir.join("bad.rules").display()
        )),
        "{text}"
    );

    std::fs::create_dir_all(dir.join("a-directory.rules")).expect("mkdir");
    let checked = lang::check_source("acl.pipe", &pipeline("a-directory.rules"), &dir);
    assert!(
        checked
            .render()
            .contains("cannot read rule file `a-directory.rules`"),
        "{}",
        checked.render()
    );

    std::fs::write(dir.join("binary.rules"), [0xff, 0xfe, 0x00]).expect("write");
    let checked = lang::check_source("acl.pipe", &pipeline("binary.rules"), &dir);
    assert!(
        checked
            .render()
            .contains("cannot read rule file `binary.rules`: not UTF-8 text"),
        "{}",
        checked.render()
    );
    std::fs::remove_dir_all(&dir).expect("clean up");
}

fn tempdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dpuflow-classbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}

/// A batch whose root pipe is classified together (keys of up to 32 packets at a time, the
/// answers scattered back) gets the same entry for every packet as one packet at a time:
/// 100 packets, mixing ClassBench traffic on the rule pipe's port, random frames, frames
/// the parser refuses and packets on a port with no pipe.
#[test]
fn batched_root_classification_matches_packet_by_packet() {
    use dpuflow::engine::{Engine, NoObserver, PacketBuf, Verdict};
    use dpuflow::ir::PortId;
    let dir = classbench_dir();
    let program = lang::check_source("acl.pipe", &pipeline("acl1_1k"), &dir)
        .program
        .expect("valid");
    let (inside, outside) = (PortId(0), PortId(1));
    let hits = dpuflow::traffic::generate(&program, inside, 64, 60);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let frames: Vec<(Vec<u8>, PortId)> = (0..100)
        .map(|i| match next() % 5 {
            0 => {
                // Random addresses and ports over a hit's headers.
                let mut f = hits[i % hits.len()].clone();
                for b in &mut f[26..38] {
                    *b = next() as u8;
                }
                (f, inside)
            }
            1 => (hits[i % hits.len()][..20].to_vec(), inside),
            2 => (hits[i % hits.len()].clone(), outside),
            _ => (hits[i % hits.len()].clone(), inside),
        })
        .collect();
    let run = |batch_size: usize| {
        let mut engine = Engine::new(&program);
        let mut verdicts = Vec::new();
        for part in frames.chunks(batch_size) {
            let mut batch: Vec<PacketBuf> = part
                .iter()
                .map(|(f, port)| {
                    let mut p = PacketBuf::new(2048);
                    assert!(p.load(f, *port, 1_000));
                    p
                })
                .collect();
            engine.process(&mut batch, &mut NoObserver);
            verdicts.extend(batch.iter().map(|p| p.verdict));
        }
        let entries: Vec<u64> = engine.stats().entries[0]
            .iter()
            .map(|c| c.packets)
            .collect();
        (verdicts, entries)
    };
    let (one_by_one, entries) = run(1);
    assert!(
        one_by_one.iter().any(|v| matches!(v, Verdict::Forward(_))),
        "some packets match a rule"
    );
    assert!(
        entries.iter().filter(|&&n| n > 0).count() > 10,
        "many rules hit"
    );
    assert_eq!(run(100), (one_by_one.clone(), entries.clone()));
    assert_eq!(run(33), (one_by_one, entries));
}
