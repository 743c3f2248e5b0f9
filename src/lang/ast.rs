//! The syntax tree of a pipeline file: what was written, with spans, before any checking.
//! Values stay as words here; `lang::lower` gives them meaning.

use super::diag::Span;

/// A word or a string as written, with its location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Word {
    pub text: String,
    pub span: Span,
    /// Written as a quoted string.
    pub quoted: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct File {
    pub items: Vec<Item>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Pipeline(Word),
    /// `port`, `meter`, `service`: a named block of options.
    Named(NamedBlock),
    /// `conntrack`, `telemetry`: an unnamed block of options.
    Settings(Settings),
    Pipe(Pipe),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Port,
    Meter,
    Service,
    Conntrack,
    Telemetry,
}

impl BlockKind {
    pub fn keyword(self) -> &'static str {
        match self {
            BlockKind::Port => "port",
            BlockKind::Meter => "meter",
            BlockKind::Service => "service",
            BlockKind::Conntrack => "conntrack",
            BlockKind::Telemetry => "telemetry",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedBlock {
    pub kind: BlockKind,
    pub keyword: Span,
    pub name: Word,
    pub options: Vec<Opt>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub kind: BlockKind,
    pub keyword: Span,
    pub options: Vec<Opt>,
}

/// `key value…` inside a block, or `key { key value… }` for a nested block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opt {
    pub key: Word,
    pub values: Vec<Word>,
    pub block: Option<Vec<Opt>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipe {
    pub name: Word,
    pub root: Option<Span>,
    pub from: Vec<Word>,
    pub items: Vec<PipeItem>,
    /// The closing brace, where "missing default" points.
    pub end: Span,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PipeItem {
    Rule(Rule),
    Default { keyword: Span, actions: Vec<Action> },
    Table(Table),
    RulesFrom(RulesFrom),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: Word,
    pub matches: Vec<Match>,
    pub actions: Vec<Action>,
    /// From `rule` to the closing brace.
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match {
    pub field: Word,
    pub value: MatchValue,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchValue {
    One(Word),
    /// `{a, b, c}`
    Set(Vec<Word>, Span),
}

impl MatchValue {
    pub fn span(&self) -> Span {
        match self {
            MatchValue::One(w) => w.span,
            MatchValue::Set(_, s) => *s,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    pub name: Word,
    pub args: Vec<Word>,
    /// `vxlan.encap { … }`, `vlan.push { … }`
    pub block: Option<Vec<Opt>>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub keyword: Span,
    pub kind: Word,
    pub fields: Vec<Word>,
    pub entries: Vec<TableEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableEntry {
    pub key: Vec<Word>,
    pub actions: Vec<Action>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesFrom {
    pub keyword: Span,
    pub path: Word,
    pub actions: Vec<Action>,
}
