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
fn language_doc_examples_check_clean() {
    let doc = std::fs::read_to_string("docs/pipeline-language.md").expect("doc");
    let blocks = pipe_blocks(&doc);
    assert!(
        blocks.len() >= 5,
        "expected the doc's examples, found {}",
        blocks.len()
    );
    for (line, text) in blocks {
        let checked = lang::check_source(
            &format!("docs/pipeline-language.md@{line}"),
            &text,
            Path::new("docs"),
        );
        assert!(
            checked.diagnostics.is_empty(),
            "example at line {line}:\n{}",
            checked.render()
        );
    }
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
