//! The syntax tree of a pipeline file: what was written, with spans, before any checking.
//! Values stay as words here; `lang::lower` gives them meaning.

use super::diag::Span;
use std::borrow::Cow;

/// A word or a string as written, with its location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Word<'a> {
    pub text: Cow<'a, str>,
    pub span: Span,
    /// Written as a quoted string.
    pub quoted: bool,
}

impl Word<'_> {
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct File<'a> {
    pub items: Vec<Item<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item<'a> {
    Pipeline(Word<'a>),
    /// `port`, `meter`, `service`: a named block of options.
    Named(NamedBlock<'a>),
    /// `conntrack`, `telemetry`: an unnamed block of options.
    Settings(Settings<'a>),
    Pipe(Pipe<'a>),
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
pub struct NamedBlock<'a> {
    pub kind: BlockKind,
    pub keyword: Span,
    pub name: Word<'a>,
    pub options: Vec<Opt<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings<'a> {
    pub kind: BlockKind,
    pub keyword: Span,
    pub options: Vec<Opt<'a>>,
}

/// `key value…` inside a block, or `key { key value… }` for a nested block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opt<'a> {
    pub key: Word<'a>,
    pub values: Vec<Word<'a>>,
    pub block: Option<Vec<Opt<'a>>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipe<'a> {
    pub name: Word<'a>,
    pub root: Option<Span>,
    pub from: Vec<Word<'a>>,
    pub items: Vec<PipeItem<'a>>,
    /// The closing brace, where "missing default" points.
    pub end: Span,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PipeItem<'a> {
    Rule(Rule<'a>),
    Default {
        keyword: Span,
        actions: Vec<Action<'a>>,
    },
    Table(Table<'a>),
    RulesFrom(RulesFrom<'a>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule<'a> {
    pub name: Word<'a>,
    pub matches: Vec<Match<'a>>,
    pub actions: Vec<Action<'a>>,
    /// From `rule` to the closing brace.
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Match<'a> {
    pub field: Word<'a>,
    pub value: MatchValue<'a>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MatchValue<'a> {
    One(Word<'a>),
    /// `{a, b, c}`
    Set(Vec<Word<'a>>, Span),
}

impl MatchValue<'_> {
    pub fn span(&self) -> Span {
        match self {
            MatchValue::One(w) => w.span,
            MatchValue::Set(_, s) => *s,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action<'a> {
    pub name: Word<'a>,
    pub args: Vec<Word<'a>>,
    /// `vxlan.encap { … }`, `vlan.push { … }`
    pub block: Option<Vec<Opt<'a>>>,
    pub span: Span,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table<'a> {
    pub keyword: Span,
    pub kind: Word<'a>,
    pub fields: Vec<Word<'a>>,
    pub entries: Vec<TableEntry<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableEntry<'a> {
    pub key: Vec<Word<'a>>,
    pub actions: Vec<Action<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RulesFrom<'a> {
    pub keyword: Span,
    pub path: Word<'a>,
    pub actions: Vec<Action<'a>>,
}
