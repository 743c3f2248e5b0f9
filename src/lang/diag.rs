//! Diagnostics: source files, spans, and rustc-style rendering.
//!
//! Every message points at a byte span of a loaded file. Rendering turns the span into
//! `FILE:LINE:COL`, prints the source line with a caret under the span, then a hint.

use serde::Serialize;
use std::fmt::Write as _;

/// Index of a file in a [`SourceMap`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileId(pub u32);

/// A byte range `start..end` in one source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Span {
    pub file: FileId,
    pub start: u32,
    pub end: u32,
}

impl Span {
    pub fn new(file: FileId, start: usize, end: usize) -> Self {
        Span {
            file,
            start: start as u32,
            end: end as u32,
        }
    }

    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span {
            file: self.file,
            start: self.start.min(other.start),
            end: self.end.max(other.end),
        }
    }
}

/// One loaded file with its line index.
#[derive(Debug)]
pub struct SourceFile {
    pub name: String,
    pub text: String,
    line_starts: Vec<u32>,
}

impl SourceFile {
    fn new(name: String, text: String) -> Self {
        let line_starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i as u32 + 1))
            .collect();
        SourceFile {
            name,
            text,
            line_starts,
        }
    }

    /// 1-based line and column (in characters) of a byte offset.
    pub fn line_col(&self, offset: u32) -> (usize, usize) {
        let mut offset = offset.min(self.text.len() as u32);
        while !self.text.is_char_boundary(offset as usize) {
            offset -= 1;
        }
        let line = self.line_starts.partition_point(|&s| s <= offset) - 1;
        let start = self.line_starts[line] as usize;
        let col = self.text[start..offset as usize].chars().count() + 1;
        (line + 1, col)
    }

    /// The text of a 1-based line, without its newline.
    pub fn line_text(&self, line: usize) -> &str {
        let start = self.line_starts[line - 1] as usize;
        let end = self
            .line_starts
            .get(line)
            .map_or(self.text.len(), |&e| e as usize);
        self.text[start..end].trim_end_matches(['\n', '\r'])
    }
}

/// All files loaded for one check: the pipeline file and the rule files it reads.
#[derive(Debug, Default)]
pub struct SourceMap {
    files: Vec<SourceFile>,
}

impl SourceMap {
    pub fn add(&mut self, name: impl Into<String>, text: String) -> FileId {
        self.files.push(SourceFile::new(name.into(), text));
        FileId(self.files.len() as u32 - 1)
    }

    pub fn file(&self, id: FileId) -> &SourceFile {
        &self.files[id.0 as usize]
    }

    pub fn text(&self, span: Span) -> &str {
        &self.file(span.file).text[span.start as usize..span.end as usize]
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

/// One finding, with an optional hint and secondary locations ("first defined here").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub span: Span,
    pub message: String,
    pub hint: Option<String>,
    pub notes: Vec<(Span, String)>,
}

impl Diagnostic {
    pub fn error(span: Span, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Error,
            span,
            message: message.into(),
            hint: None,
            notes: Vec::new(),
        }
    }

    pub fn warning(span: Span, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(span, message)
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    pub fn maybe_hint(mut self, hint: Option<String>) -> Self {
        self.hint = hint;
        self
    }

    pub fn note(mut self, span: Span, message: impl Into<String>) -> Self {
        self.notes.push((span, message.into()));
        self
    }

    /// [`Diagnostic::note`] on a diagnostic already in a list.
    pub fn add_note(&mut self, span: Span, message: impl Into<String>) -> &mut Self {
        self.notes.push((span, message.into()));
        self
    }
}

/// A diagnostic as one JSON object (`--format json`).
#[derive(Debug, Serialize)]
pub struct JsonDiagnostic<'a> {
    pub file: &'a str,
    pub line: usize,
    pub col: usize,
    pub severity: Severity,
    pub message: &'a str,
    pub hint: Option<&'a str>,
}

impl SourceMap {
    /// `FILE:LINE:COL: SEVERITY: MESSAGE`, the source line with carets, notes and the hint.
    /// The hint's `=` stands under the gutter's `|` of the last source line shown.
    pub fn render(&self, d: &Diagnostic) -> String {
        let mut out = String::new();
        let mut gutter = self.render_located(&mut out, d.span, d.severity.as_str(), &d.message);
        for (span, msg) in &d.notes {
            gutter = self.render_located(&mut out, *span, "note", msg);
        }
        if let Some(hint) = &d.hint {
            let _ = writeln!(out, "{:gutter$} = hint: {hint}", "");
        }
        out
    }

    /// Writes the located part; the width of its gutter (the line number's).
    fn render_located(&self, out: &mut String, span: Span, label: &str, msg: &str) -> usize {
        let file = self.file(span.file);
        let (line, col) = file.line_col(span.start);
        let text = file.line_text(line);
        let _ = writeln!(out, "{}:{line}:{col}: {label}: {msg}", file.name);
        let gutter = line.to_string();
        let pad = " ".repeat(gutter.len());
        let (end_line, end_col) = file.line_col(span.end.max(span.start + 1));
        let width = if end_line == line {
            end_col.saturating_sub(col).max(1)
        } else {
            text.chars().count().saturating_sub(col - 1).max(1)
        };
        // Tabs keep their width so the caret lines up under the source text.
        let lead: String = text
            .chars()
            .take(col - 1)
            .map(|c| if c == '\t' { '\t' } else { ' ' })
            .collect();
        let _ = writeln!(out, "{pad} |");
        let _ = writeln!(out, "{gutter} | {text}");
        let _ = writeln!(out, "{pad} | {lead}{}", "^".repeat(width));
        gutter.len()
    }

    pub fn json<'a>(&'a self, d: &'a Diagnostic) -> JsonDiagnostic<'a> {
        let file = self.file(d.span.file);
        let (line, col) = file.line_col(d.span.start);
        JsonDiagnostic {
            file: &file.name,
            line,
            col,
            severity: d.severity,
            message: &d.message,
            hint: d.hint.as_deref(),
        }
    }
}

/// The closest candidate to `name`, if it is close enough to be a likely typo.
pub fn closest<'a>(name: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (name.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(name, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// "did you mean `x`?" for a misspelled name, if one candidate is close.
pub fn did_you_mean<'a>(
    name: &str,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<String> {
    closest(name, candidates).map(|c| format!("did you mean `{c}`?"))
}

/// Levenshtein distance counting a swap of two neighbours as one edit.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev2 = vec![0usize; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0usize; b.len() + 1];
    for i in 1..=a.len() {
        cur[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            cur[j] = (prev[j] + 1).min(cur[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                cur[j] = cur[j].min(prev2[j - 2] + 1);
            }
        }
        std::mem::swap(&mut prev2, &mut prev);
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        let fields = ["ipv4.dst", "ipv4.src", "ipv6.dst"];
        assert_eq!(closest("ipv4.dts", fields), Some("ipv4.dst"));
        assert_eq!(closest("ipv4.dstt", fields), Some("ipv4.dst"));
        assert_eq!(closest("tcp.flags", fields), None);
    }

    #[test]
    fn renders_caret_under_span() {
        let mut map = SourceMap::default();
        let f = map.add("a.pipe", "pipeline x\nport p { driver pcapp }\n".into());
        let d = Diagnostic::error(Span::new(f, 25, 30), "unknown driver `pcapp`")
            .hint("did you mean `pcap`?");
        assert_eq!(
            map.render(&d),
            "a.pipe:2:15: error: unknown driver `pcapp`\n  |\n2 | port p { driver pcapp }\n  |               ^^^^^\n  = hint: did you mean `pcap`?\n"
        );
    }

    #[test]
    fn line_col_at_end_of_file() {
        let mut map = SourceMap::default();
        let f = map.add("a", "ab\ncd".into());
        assert_eq!(map.file(f).line_col(5), (2, 3));
        assert_eq!(map.file(f).line_col(3), (2, 1));
    }
}
