//! Tokens of a pipeline file.
//!
//! The language has few token kinds. Everything that is not punctuation or a string is a
//! *word*: names (`ingress`), field and action names (`ipv4.dst`, `vxlan.encap`) and values
//! (`10.0.0.0/8`, `1024-65535`, `02:00:00:00:00:01`, `2001:db8::/32`, `10s`). What a word
//! means depends on where it stands, so values are parsed later by [`super::value`].

use super::diag::{Diagnostic, FileId, Span};
use nom::branch::alt;
use nom::bytes::complete::{escaped_transform, is_not, tag, take_while1};
use nom::character::complete::{char, multispace1, not_line_ending};
use nom::combinator::{map, value};
use nom::sequence::{delimited, pair};
use nom::IResult;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenKind {
    Word,
    /// A double-quoted string; the token's `text` is its unescaped content.
    Str,
    LBrace,
    RBrace,
    Comma,
    /// `=>`, between a table key and its actions.
    Arrow,
    Eof,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Token {
    pub kind: TokenKind,
    pub text: String,
    pub span: Span,
}

/// Characters a word may contain.
pub fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '/' | '-' | '[' | ']' | '+' | '*')
}

#[derive(Clone)]
enum Lexeme {
    Skip,
    Word,
    Str(String),
    Punct(TokenKind),
}

fn comment(i: &str) -> IResult<&str, Lexeme> {
    value(Lexeme::Skip, pair(char('#'), not_line_ending))(i)
}

fn string(i: &str) -> IResult<&str, Lexeme> {
    let escape = alt((
        value("\\", tag("\\")),
        value("\"", tag("\"")),
        value("\n", tag("n")),
        value("\t", tag("t")),
    ));
    let body = alt((
        escaped_transform(is_not("\\\"\n"), '\\', escape),
        map(tag(""), String::from),
    ));
    map(delimited(char('"'), body, char('"')), Lexeme::Str)(i)
}

fn lexeme(i: &str) -> IResult<&str, Lexeme> {
    alt((
        value(Lexeme::Skip, multispace1),
        comment,
        value(Lexeme::Word, take_while1(is_word_char)),
        string,
        value(Lexeme::Punct(TokenKind::Arrow), tag("=>")),
        value(Lexeme::Punct(TokenKind::LBrace), char('{')),
        value(Lexeme::Punct(TokenKind::RBrace), char('}')),
        value(Lexeme::Punct(TokenKind::Comma), char(',')),
    ))(i)
}

/// Splits `src` into tokens. Bad characters and unterminated strings become diagnostics and
/// lexing goes on after them; the token list always ends with [`TokenKind::Eof`].
pub fn tokenize(file: FileId, src: &str, diags: &mut Vec<Diagnostic>) -> Vec<Token> {
    let mut tokens = Vec::new();
    let mut rest = src;
    while !rest.is_empty() {
        let start = src.len() - rest.len();
        match lexeme(rest) {
            Ok((next, lx)) => {
                let end = src.len() - next.len();
                let span = Span::new(file, start, end);
                let (kind, text) = match lx {
                    Lexeme::Skip => {
                        rest = next;
                        continue;
                    }
                    Lexeme::Word => (TokenKind::Word, src[start..end].to_owned()),
                    Lexeme::Str(s) => (TokenKind::Str, s),
                    Lexeme::Punct(k) => (k, src[start..end].to_owned()),
                };
                tokens.push(Token { kind, text, span });
                rest = next;
            }
            Err(_) => {
                let c = rest.chars().next().unwrap_or(' ');
                let len = if c == '"' {
                    // Unterminated string: report it once and skip to the end of the line.
                    let n = rest.find('\n').unwrap_or(rest.len());
                    diags.push(
                        Diagnostic::error(Span::new(file, start, start + 1), "unterminated string")
                            .hint("close the string with `\"` on the same line"),
                    );
                    n
                } else {
                    diags.push(Diagnostic::error(
                        Span::new(file, start, start + c.len_utf8()),
                        format!("unexpected character `{}`", c.escape_default()),
                    ));
                    c.len_utf8()
                };
                rest = &rest[len..];
            }
        }
    }
    tokens.push(Token {
        kind: TokenKind::Eof,
        text: String::new(),
        span: Span::new(file, src.len(), src.len()),
    });
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Vec<(TokenKind, String)> {
        let mut d = Vec::new();
        let t = tokenize(FileId(0), src, &mut d);
        assert!(d.is_empty(), "{d:?}");
        t.into_iter().map(|t| (t.kind, t.text)).collect()
    }

    #[test]
    fn words_strings_and_punctuation() {
        use TokenKind::*;
        assert_eq!(
            kinds("rule a { match ipv6.dst 2001:db8::/32 # c\n actions fwd \"p\\\"q\" } =>,"),
            vec![
                (Word, "rule".into()),
                (Word, "a".into()),
                (LBrace, "{".into()),
                (Word, "match".into()),
                (Word, "ipv6.dst".into()),
                (Word, "2001:db8::/32".into()),
                (Word, "actions".into()),
                (Word, "fwd".into()),
                (Str, "p\"q".into()),
                (RBrace, "}".into()),
                (Arrow, "=>".into()),
                (Comma, ",".into()),
                (Eof, "".into()),
            ]
        );
    }

    #[test]
    fn bad_characters_are_reported_and_skipped() {
        let mut d = Vec::new();
        let t = tokenize(FileId(0), "a ; b \"open\nc", &mut d);
        assert_eq!(d.len(), 2);
        assert_eq!(t.iter().filter(|t| t.kind == TokenKind::Word).count(), 3);
    }
}
