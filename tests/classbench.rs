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
