//! Recursive-descent parser from tokens to the syntax tree, with error recovery.
//!
//! After an error the parser skips to the end of the rule or block it was in and carries
//! on, so one run reports at least one error per rule or block. Which words a construct
//! takes is fixed by the tables below (block keys, action arities); their meaning is
//! checked later, in `lang::lower`.

use super::ast::*;
use super::diag::{did_you_mean, Diagnostic, FileId, Span};
use super::lexer::{tokenize, Token, TokenKind};

/// How many words follow a key in an option block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Values {
    One,
    Two,
    Three,
    /// A number and an optional separate unit word: `rate 10 mbps` or `rate 10mbps`.
    Quantity,
}

/// The keys of one kind of option block.
pub type Keys = &'static [(&'static str, Values)];

/// Keys each option block accepts.
pub fn block_keys(kind: BlockKind) -> Keys {
    use Values::*;
    match kind {
        BlockKind::Port => &[
            ("driver", One),
            ("iface", One),
            ("queues", One),
            ("mtu", One),
            ("address", One),
            ("file", One),
            ("out", One),
        ],
        BlockKind::Meter => &[
            ("rate", Quantity),
            ("burst", Quantity),
            ("excess_burst", Quantity),
            ("peak", Quantity),
            ("peak_burst", Quantity),
        ],
        BlockKind::Service => &[
            ("type", One),
            ("listen", One),
            ("target", One),
            ("capacity", Quantity),
            ("block_size", Quantity),
            ("stripe", Quantity),
            ("connections", One),
            ("inline_max", Quantity),
            ("checkpoint", One),
            ("nvme_digest", One),
            ("page_cache", One),
            ("discard", One),
            ("io_timeout", One),
            ("max_clients", One),
            ("slowlog", One),
            ("cluster_node", One),
            ("cluster_leaving", One),
            ("password_file", One),
            ("tls_cert", One),
            ("tls_key", One),
            ("tls_client_ca", One),
        ],
        BlockKind::Conntrack => &[
            ("capacity", One),
            ("timeout", Two),
            ("tcp_window", One),
            ("tcp_loose", One),
            ("checksum", One),
        ],
        BlockKind::Telemetry => &[
            ("prometheus", One),
            ("ipfix", One),
            ("interval", One),
            ("idle_timeout", One),
            ("template_refresh", One),
            ("max_rule_series", One),
            ("sampling", One),
            ("flow_cache", One),
            ("observation_domain", One),
            ("ipfix_mtu", One),
            ("ipfix_rate", One),
            ("tls_cert", One),
            ("tls_key", One),
            ("tls_client_ca", One),
            ("basic_auth_file", One),
        ],
    }
}

/// Keys of the `vxlan.encap { … }` / `geneve.encap { … }` block.
pub const ENCAP_KEYS: Keys = &[
    ("vni", Values::One),
    ("src", Values::One),
    ("dst", Values::One),
    ("smac", Values::One),
    ("dmac", Values::One),
    ("dport", Values::One),
    ("ttl", Values::One),
    ("dscp", Values::One),
    ("option", Values::Three),
];
/// Keys of the `vlan.push { … }` block.
pub const VLAN_PUSH_KEYS: Keys = &[("id", Values::One), ("pcp", Values::One)];

fn key_of(keys: Keys, word: &str) -> Option<Values> {
    keys.iter().find(|(k, _)| *k == word).map(|&(_, v)| v)
}

/// How a key of several values is written, for the error when some are missing.
fn example_of(key: &str) -> Option<&'static str> {
    match key {
        "timeout" => Some("timeout tcp_established 5d"),
        "option" => Some("option 0x0102 0x80 0x0000000a"),
        _ => None,
    }
}

/// What follows an action's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arity {
    Zero,
    One,
    Two,
    Block(Keys),
    OneOrBlock(Keys),
    /// `ct.commit` or `ct.commit zone N`.
    OptionalZone,
    /// One value, then optionally this word.
    OneThenWord(&'static str),
}

const ACTIONS: &[(&str, Arity)] = &[
    ("fwd", Arity::One),
    ("goto", Arity::One),
    ("drop", Arity::Zero),
    ("to", Arity::One),
    ("count", Arity::Zero),
    ("meter", Arity::One),
    ("mirror", Arity::One),
    ("set", Arity::Two),
    ("dec", Arity::One),
    ("clamp", Arity::Two),
    ("mark", Arity::One),
    ("arp.reply", Arity::One),
    ("nd.advert", Arity::OneThenWord("router")),
    ("echo.reply", Arity::Zero),
    ("vlan.push", Arity::OneOrBlock(VLAN_PUSH_KEYS)),
    ("vlan.pop", Arity::Zero),
    ("vxlan.encap", Arity::Block(ENCAP_KEYS)),
    ("vxlan.decap", Arity::Zero),
    ("geneve.encap", Arity::Block(ENCAP_KEYS)),
    ("geneve.decap", Arity::Zero),
    ("ct.commit", Arity::OptionalZone),
];

/// Every action name, for suggestions.
pub fn action_names() -> impl Iterator<Item = &'static str> {
    ACTIONS.iter().map(|(n, _)| *n)
}

const TOP_KEYWORDS: &[&str] = &[
    "pipeline",
    "port",
    "meter",
    "service",
    "conntrack",
    "telemetry",
    "pipe",
];
const PIPE_KEYWORDS: &[&str] = &["rule", "default", "table", "rules"];

/// Marker for "an error was reported; recover".
struct Reported;
type PResult<T> = Result<T, Reported>;

struct Parser<'a, 'd> {
    tokens: Vec<Token<'a>>,
    pos: usize,
    /// Brace nesting of the tokens consumed so far.
    depth: usize,
    diags: &'d mut Vec<Diagnostic>,
}

/// Parses one pipeline file. Errors go to `diags`; the tree holds whatever parsed.
pub fn parse<'a>(file: FileId, src: &'a str, diags: &mut Vec<Diagnostic>) -> File<'a> {
    let tokens = tokenize(file, src, diags);
    let mut p = Parser {
        tokens,
        pos: 0,
        depth: 0,
        diags,
    };
    p.file()
}

impl<'a> Parser<'a, '_> {
    fn peek(&self) -> &Token<'a> {
        &self.tokens[self.pos]
    }

    fn peek_is_word(&self, w: &str) -> bool {
        let t = self.peek();
        t.kind == TokenKind::Word && t.text == w
    }

    fn at(&self, kind: TokenKind) -> bool {
        self.peek().kind == kind
    }

    fn bump(&mut self) -> Token<'a> {
        let t = self.tokens[self.pos].clone();
        match t.kind {
            TokenKind::Eof => return t,
            TokenKind::LBrace => self.depth += 1,
            TokenKind::RBrace => self.depth = self.depth.saturating_sub(1),
            _ => {}
        }
        self.pos += 1;
        t
    }

    fn error(&mut self, span: Span, msg: impl Into<String>, hint: Option<String>) -> Reported {
        self.diags
            .push(Diagnostic::error(span, msg).maybe_hint(hint));
        Reported
    }

    fn describe(t: &Token<'a>) -> String {
        match t.kind {
            TokenKind::Word => format!("`{}`", t.text),
            TokenKind::Str => format!("string \"{}\"", t.text),
            TokenKind::LBrace => "`{`".into(),
            TokenKind::RBrace => "`}`".into(),
            TokenKind::Comma => "`,`".into(),
            TokenKind::Arrow => "`=>`".into(),
            TokenKind::Eof => "end of file".into(),
        }
    }

    fn unexpected(&mut self, expected: &str) -> Reported {
        let t = self.peek().clone();
        self.error(
            t.span,
            format!("expected {expected}, found {}", Self::describe(&t)),
            None,
        )
    }

    fn expect(&mut self, kind: TokenKind, what: &str) -> PResult<Token<'a>> {
        if self.at(kind) {
            Ok(self.bump())
        } else {
            Err(self.unexpected(what))
        }
    }

    fn keyword(&mut self, kw: &str) -> PResult<Span> {
        if self.peek_is_word(kw) {
            Ok(self.bump().span)
        } else {
            Err(self.unexpected(&format!("`{kw}`")))
        }
    }

    /// A name: a word that is not punctuation.
    fn name(&mut self, what: &str) -> PResult<Word<'a>> {
        if self.at(TokenKind::Word) {
            let t = self.bump();
            Ok(Word {
                text: t.text,
                span: t.span,
                quoted: false,
            })
        } else {
            Err(self.unexpected(what))
        }
    }

    /// A value: a word or a string.
    fn value(&mut self, what: &str) -> PResult<Word<'a>> {
        self.value_or(|| what.to_owned())
    }

    /// [`Parser::value`], saying what was expected only when it is missing: an action's
    /// arguments are read for each of a table's entries.
    fn value_or(&mut self, what: impl FnOnce() -> String) -> PResult<Word<'a>> {
        match self.peek().kind {
            TokenKind::Word | TokenKind::Str => {
                let t = self.bump();
                Ok(Word {
                    quoted: t.kind == TokenKind::Str,
                    text: t.text,
                    span: t.span,
                })
            }
            _ => Err(self.unexpected(&what())),
        }
    }

    /// Skips tokens until, at brace depth `depth`, the next token is `}` or one of `stop`,
    /// or until the `}` closing the block the error was in has been consumed.
    fn sync(&mut self, depth: usize, stop: &[&str]) {
        loop {
            let t = self.peek();
            if t.kind == TokenKind::Eof || self.depth < depth {
                return;
            }
            if self.depth == depth
                && (t.kind == TokenKind::RBrace
                    || (t.kind == TokenKind::Word && stop.contains(&&*t.text)))
            {
                return;
            }
            if self.bump().kind == TokenKind::RBrace && self.depth == depth {
                return;
            }
        }
    }

    fn file(&mut self) -> File<'a> {
        let mut file = File::default();
        while !self.at(TokenKind::Eof) {
            let start = self.pos;
            match self.item() {
                Ok(item) => file.items.push(item),
                Err(Reported) => {
                    if self.pos == start {
                        self.bump();
                    }
                    self.sync(0, TOP_KEYWORDS);
                    if self.depth == 0 && self.at(TokenKind::RBrace) {
                        // A stray `}` at top level: report it and go on.
                        let t = self.bump();
                        self.error(t.span, "unmatched `}`", None);
                    }
                }
            }
        }
        file
    }

    fn item(&mut self) -> PResult<Item<'a>> {
        let t = self.peek().clone();
        if t.kind != TokenKind::Word {
            return Err(self.unexpected("`pipeline`, `port`, `pipe` or another top-level item"));
        }
        let kind = match &*t.text {
            "pipeline" => {
                self.bump();
                return Ok(Item::Pipeline(self.name("a pipeline name")?));
            }
            "pipe" => return self.pipe().map(Item::Pipe),
            "port" => BlockKind::Port,
            "meter" => BlockKind::Meter,
            "service" => BlockKind::Service,
            "conntrack" => BlockKind::Conntrack,
            "telemetry" => BlockKind::Telemetry,
            other => {
                let hint = did_you_mean(other, TOP_KEYWORDS.iter().copied());
                return Err(self.error(t.span, format!("unknown item `{other}`"), hint.or_else(|| {
                    Some("a file holds `pipeline`, `port`, `meter`, `service`, `conntrack`, `telemetry` and `pipe` items".into())
                })));
            }
        };
        let keyword = self.bump().span;
        if matches!(kind, BlockKind::Conntrack | BlockKind::Telemetry) {
            let options = self.option_block(block_keys(kind))?;
            Ok(Item::Settings(Settings {
                kind,
                keyword,
                options,
            }))
        } else {
            let name = self.name(&format!("a {} name", kind.keyword()))?;
            let options = self.option_block(block_keys(kind))?;
            Ok(Item::Named(NamedBlock {
                kind,
                keyword,
                name,
                options,
            }))
        }
    }

    /// `{ key value… key value… }`; unknown keys are reported and skipped, and the block
    /// keeps what did parse so its name stays declared (no cascade of "undefined" errors).
    fn option_block(&mut self, keys: Keys) -> PResult<Vec<Opt<'a>>> {
        self.expect(TokenKind::LBrace, "`{`")?;
        let depth = self.depth;
        let mut opts = Vec::new();
        let is_value = |t: &Token<'a>| {
            matches!(t.kind, TokenKind::Word | TokenKind::Str) && key_of(keys, &t.text).is_none()
        };
        loop {
            let t = self.peek().clone();
            match t.kind {
                TokenKind::RBrace => {
                    self.bump();
                    break;
                }
                TokenKind::Eof => return Err(self.unexpected("`}`")),
                TokenKind::Word if key_of(keys, &t.text).is_some() => {
                    let key = self.name("a key")?;
                    let want = match key_of(keys, &key.text) {
                        Some(Values::One | Values::Quantity) => 1,
                        Some(Values::Two) => 2,
                        _ => 3,
                    };
                    let mut values = Vec::new();
                    while values.len() < want && is_value(self.peek()) {
                        values.push(self.value("a value")?);
                    }
                    let unit_follows = |v: &Word<'a>, next: &Token<'a>| {
                        v.text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
                            && next.kind == TokenKind::Word
                            && next.text.starts_with(|c: char| c.is_ascii_alphabetic())
                    };
                    if key_of(keys, &key.text) == Some(Values::Quantity)
                        && values.len() == 1
                        && is_value(self.peek())
                        && unit_follows(&values[0], self.peek())
                    {
                        values.push(self.value("a unit")?);
                    }
                    if values.len() < want {
                        let what = if want == 1 {
                            "a value".to_owned()
                        } else {
                            format!("{want} values")
                        };
                        let hint = example_of(&key.text).map(|e| format!("e.g. `{e}`"));
                        self.error(key.span, format!("`{}` needs {what}", key.text), hint);
                    } else {
                        opts.push(Opt {
                            key,
                            values,
                            block: None,
                        });
                    }
                }
                TokenKind::Word | TokenKind::Str => {
                    let names = keys.iter().map(|(k, _)| *k);
                    let hint = did_you_mean(&t.text, names.clone()).or_else(|| {
                        Some(format!(
                            "this block takes: {}",
                            names.collect::<Vec<_>>().join(", ")
                        ))
                    });
                    let msg = if t.kind == TokenKind::Str {
                        format!("unexpected string \"{}\"", t.text)
                    } else {
                        format!("unknown key `{}`", t.text)
                    };
                    self.error(t.span, msg, hint);
                    self.bump();
                    // Skip whatever values follow, up to the next known key.
                    while is_value(self.peek()) {
                        self.bump();
                    }
                }
                _ => {
                    self.unexpected("a key or `}`");
                    self.bump();
                    self.sync(depth, &[]);
                }
            }
        }
        Ok(opts)
    }

    fn pipe(&mut self) -> PResult<Pipe<'a>> {
        self.keyword("pipe")?;
        let name = self.name("a pipe name")?;
        let root = self.peek_is_word("root").then(|| self.bump().span);
        let mut from = Vec::new();
        if self.peek_is_word("from") {
            self.bump();
            from.push(self.name("a port name")?);
            while self.at(TokenKind::Comma) {
                self.bump();
                from.push(self.name("a port name")?);
            }
        }
        self.expect(TokenKind::LBrace, "`{`")?;
        let depth = self.depth;
        let mut items = Vec::new();
        let end = loop {
            let t = self.peek().clone();
            match t.kind {
                TokenKind::RBrace => break self.bump().span,
                TokenKind::Eof => return Err(self.unexpected("`}` to close the pipe")),
                _ => {}
            }
            let start = self.pos;
            match self.pipe_item() {
                Ok(item) => items.push(item),
                Err(Reported) => {
                    if self.pos == start {
                        self.bump();
                    }
                    self.sync(depth, PIPE_KEYWORDS);
                }
            }
        };
        Ok(Pipe {
            name,
            root,
            from,
            items,
            end,
        })
    }

    fn pipe_item(&mut self) -> PResult<PipeItem<'a>> {
        let t = self.peek().clone();
        match (t.kind, &*t.text) {
            (TokenKind::Word, "rule") => self.rule().map(PipeItem::Rule),
            (TokenKind::Word, "default") => {
                let keyword = self.bump().span;
                self.expect(TokenKind::LBrace, "`{`")?;
                self.keyword("actions")?;
                let actions = self.actions()?;
                self.expect(TokenKind::RBrace, "`,` or `}`")?;
                Ok(PipeItem::Default { keyword, actions })
            }
            (TokenKind::Word, "table") => self.table().map(PipeItem::Table),
            (TokenKind::Word, "rules") => {
                let keyword = self.bump().span;
                self.keyword("from")?;
                let path = self.value("a quoted file name")?;
                self.expect(TokenKind::LBrace, "`{`")?;
                self.keyword("actions")?;
                let actions = self.actions()?;
                self.expect(TokenKind::RBrace, "`,` or `}`")?;
                Ok(PipeItem::RulesFrom(RulesFrom {
                    keyword,
                    path,
                    actions,
                }))
            }
            (TokenKind::Word, other) => {
                let hint = did_you_mean(other, PIPE_KEYWORDS.iter().copied()).or_else(|| {
                    Some("a pipe holds `rule`, `table`, `rules from` and `default` items".into())
                });
                Err(self.error(t.span, format!("unknown pipe item `{other}`"), hint))
            }
            _ => Err(self.unexpected("`rule`, `table`, `rules from` or `default`")),
        }
    }

    fn rule(&mut self) -> PResult<Rule<'a>> {
        let start = self.keyword("rule")?;
        let name = self.name("a rule name")?;
        self.expect(TokenKind::LBrace, "`{`")?;
        let mut matches = Vec::new();
        if self.peek_is_word("match") {
            self.bump();
            while !self.peek_is_word("actions") {
                if !self.at(TokenKind::Word) {
                    return Err(self.unexpected("a match field or `actions`"));
                }
                let field = self.name("a match field")?;
                let value = self.match_value(&field)?;
                matches.push(Match { field, value });
            }
            if matches.is_empty() {
                let t = self.peek().clone();
                return Err(self.error(
                    t.span,
                    "`match` needs at least one field",
                    Some("leave out `match` to match every packet".into()),
                ));
            }
        }
        self.keyword("actions")?;
        let actions = self.actions()?;
        let end = self.expect(TokenKind::RBrace, "`,` or `}`")?.span;
        Ok(Rule {
            name,
            matches,
            actions,
            span: start.to(end),
        })
    }

    fn match_value(&mut self, field: &Word<'a>) -> PResult<MatchValue<'a>> {
        if self.at(TokenKind::LBrace) {
            let open = self.bump().span;
            let mut values = vec![self.value("a value")?];
            while self.at(TokenKind::Comma) {
                self.bump();
                values.push(self.value("a value")?);
            }
            let close = self.expect(TokenKind::RBrace, "`,` or `}`")?.span;
            return Ok(MatchValue::Set(values, open.to(close)));
        }
        if self.peek_is_word("actions")
            || !matches!(self.peek().kind, TokenKind::Word | TokenKind::Str)
        {
            let t = self.peek().clone();
            return Err(self.error(t.span, format!("missing value for `{}`", field.text), None));
        }
        Ok(MatchValue::One(self.value("a value")?))
    }

    /// `ACTION {, ACTION}`
    fn actions(&mut self) -> PResult<Vec<Action<'a>>> {
        let mut list = vec![self.action()?];
        while self.at(TokenKind::Comma) {
            self.bump();
            list.push(self.action()?);
        }
        Ok(list)
    }

    fn action(&mut self) -> PResult<Action<'a>> {
        let name = self.name("an action")?;
        let Some(&(_, arity)) = ACTIONS.iter().find(|(n, _)| *n == name.text) else {
            let hint = did_you_mean(&name.text, action_names());
            return Err(self.error(name.span, format!("unknown action `{}`", name.text), hint));
        };
        let mut args = Vec::with_capacity(match arity {
            Arity::One | Arity::OneOrBlock(_) => 1,
            Arity::Two | Arity::OneThenWord(_) => 2,
            Arity::Zero | Arity::Block(_) | Arity::OptionalZone => 0,
        });
        let mut block = None;
        let what = || format!("an argument for `{}`", name.text);
        match arity {
            Arity::Zero => {}
            Arity::One => args.push(self.value_or(what)?),
            Arity::Two => {
                args.push(self.value_or(what)?);
                args.push(self.value_or(what)?);
            }
            Arity::Block(keys) => block = Some(self.option_block(keys)?),
            Arity::OneOrBlock(keys) => {
                if self.at(TokenKind::LBrace) {
                    block = Some(self.option_block(keys)?);
                } else {
                    args.push(self.value_or(what)?);
                }
            }
            Arity::OneThenWord(word) => {
                args.push(self.value_or(what)?);
                if self.peek_is_word(word) {
                    args.push(self.value_or(what)?);
                }
            }
            Arity::OptionalZone => {
                if self.peek_is_word("zone") {
                    args.push(self.value_or(what)?);
                    args.push(self.value("a zone number")?);
                }
            }
        }
        let end = self.tokens[self.pos.saturating_sub(1)].span;
        Ok(Action {
            span: name.span.to(end),
            name,
            args,
            block,
        })
    }

    fn table(&mut self) -> PResult<Table<'a>> {
        let keyword = self.keyword("table")?;
        let kind = self.name("`exact` or `lpm`")?;
        let mut fields = Vec::new();
        while self.at(TokenKind::Word) {
            fields.push(self.name("a field")?);
        }
        if fields.is_empty() {
            return Err(self.unexpected("the table's key fields"));
        }
        self.expect(TokenKind::LBrace, "`{`")?;
        let mut entries = Vec::new();
        while !self.at(TokenKind::RBrace) {
            let mut key = Vec::with_capacity(fields.len());
            while matches!(self.peek().kind, TokenKind::Word | TokenKind::Str) {
                key.push(self.value("a key value")?);
            }
            if key.is_empty() {
                return Err(self.unexpected("a key value or `}`"));
            }
            self.expect(TokenKind::Arrow, "`=>`")?;
            let actions = self.actions()?;
            entries.push(TableEntry { key, actions });
        }
        self.bump();
        Ok(Table {
            keyword,
            kind,
            fields,
            entries,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(src: &str) -> File<'_> {
        let mut d = Vec::new();
        let f = parse(FileId(0), src, &mut d);
        assert!(d.is_empty(), "{d:#?}");
        f
    }

    #[test]
    fn parses_a_pipe_with_rules_and_default() {
        let f = parse_ok(
            "pipeline p\nport a { driver pcap }\npipe x root from a {\n rule r { match tcp.dst {80, 443} ipv4.src 10.0.0.0/8 actions count, fwd a }\n default { actions drop }\n}\n",
        );
        assert_eq!(f.items.len(), 3);
        let Item::Pipe(p) = &f.items[2] else { panic!() };
        assert_eq!(p.items.len(), 2);
        let PipeItem::Rule(r) = &p.items[0] else {
            panic!()
        };
        assert_eq!(r.matches.len(), 2);
        assert_eq!(r.actions.len(), 2);
    }

    #[test]
    fn table_entries_end_at_next_key() {
        let f = parse_ok(
            "pipe o { table lpm ipv4.dst { 10.1.0.0/16 => vxlan.encap { vni 1 src 1.1.1.1 }, fwd up 10.2.0.0/16 => drop } default { actions drop } }",
        );
        let Item::Pipe(p) = &f.items[0] else { panic!() };
        let PipeItem::Table(t) = &p.items[0] else {
            panic!()
        };
        assert_eq!(t.entries.len(), 2);
        assert_eq!(t.entries[0].actions.len(), 2);
    }

    #[test]
    fn one_error_per_broken_rule() {
        let mut d = Vec::new();
        parse(
            FileId(0),
            "pipe x {\n rule a { match tcp.dst actions drop }\n rule b { actions fwdd p }\n rule c { actions drop }\n default { actions drop }\n}\nport q { drivr pcap }\n",
            &mut d,
        );
        let msgs: Vec<_> = d.iter().map(|d| d.message.as_str()).collect();
        assert_eq!(
            msgs,
            [
                "missing value for `tcp.dst`",
                "unknown action `fwdd`",
                "unknown key `drivr`"
            ]
        );
    }
}
