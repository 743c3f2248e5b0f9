//! The documentation cannot rot: every ```pipe example in docs/ and the README is checked,
//! and every field and action the checker knows is documented.

use dpuflow::{ir, lang};
use std::path::Path;

fn pipe_blocks(doc: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (n, line) in doc.lines().enumerate() {
        match (&mut current, line.trim_start()) {
            (None, l) if l.starts_with("```pipe") => current = Some((n + 2, String::new())),
            (Some(_), l) if l.starts_with("```") => {
                blocks.push(current.take().expect("open block"))
            }
            (Some((_, text)), _) => {
                text.push_str(line);
                text.push('\n');
            }
            _ => {}
        }
    }
    blocks
}

#[test]
fn doc_examples_check_clean() {
    let mut count = 0;
    for doc in [
        "README.md",
        "docs/pipeline-language.md",
        "docs/operations.md",
        "docs/architecture.md",
    ] {
        let text = std::fs::read_to_string(doc).expect("doc");
        for (line, block) in pipe_blocks(&text) {
            let checked = lang::check_source(&format!("{doc}@{line}"), &block, Path::new("docs"));
            assert!(
                checked.diagnostics.is_empty(),
                "example at {doc}:{line}:\n{}",
                checked.render()
            );
            count += 1;
        }
    }
    assert!(count >= 6, "expected the docs' examples, found {count}");
}

#[test]
fn every_field_and_action_is_documented() {
    let doc = std::fs::read_to_string("docs/pipeline-language.md").expect("doc");
    for f in ir::FIELDS {
        assert!(
            doc.contains(&format!("| `{}` |", f.name)),
            "field {} is not in the field table",
            f.name
        );
    }
    for a in lang::parser::action_names() {
        assert!(
            doc.contains(&format!("`{a}")),
            "action {a} is not documented"
        );
    }
}
