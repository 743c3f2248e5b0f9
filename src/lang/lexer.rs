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
use nom::combinator::{map, peek, value};
use nom::sequence::{delimited, pair, terminated};
use nom::IResult;
use std::borrow::Cow;

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
pub struct Token<'a> {
    pub kind: TokenKind,
    /// The text as written; a string's unescaped content, owned only when it held escapes.
    pub text: Cow<'a, str>,
    pub span: Span,
}

/// Characters a word may contain.
pub fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '/' | '-' | '[' | ']' | '+' | '*')
}

#[derive(Clone)]
enum Lexeme<'a> {
    Skip,
    Word,
    Str(Cow<'a, str>),
    Punct(TokenKind),
}

fn comment(i: &str) -> IResult<&str, Lexeme<'_>> {
    value(Lexeme::Skip, pair(char('#'), not_line_ending))(i)
}

/// A quoted string, borrowed from the source unless it holds escapes.
fn string(i: &str) -> IResult<&str, Lexeme<'_>> {
    let escape = alt((
        value("\\", tag("\\")),
        value("\"", tag("\"")),
        value("\n", tag("n")),
        value("\t", tag("t")),
    ));
    let plain = terminated(is_not("\\\"\n"), peek(char('"')));
    let body = alt((
        map(plain, Cow::Borrowed),
        map(
            escaped_transform(is_not("\\\"\n"), '\\', escape),
            Cow::Owned,
        ),
        map(tag(""), Cow::Borrowed),
    ));
    map(delimited(char('"'), body, char('"')), Lexeme::Str)(i)
}

/// The next lexeme, told by its first character: most of a large file is words and
/// spaces, which would otherwise each fail several parsers first.
fn lexeme(i: &str) -> IResult<&str, Lexeme<'_>> {
    match i.as_bytes()[0] {
        b' ' | b'\t' | b'\n' | b'\r' => value(Lexeme::Skip, multispace1)(i),
        b'#' => comment(i),
        b'"' => string(i),
        b'=' => value(Lexeme::Punct(TokenKind::Arrow), tag("=>"))(i),
        b'{' => value(Lexeme::Punct(TokenKind::LBrace), char('{'))(i),
        b'}' => value(Lexeme::Punct(TokenKind::RBrace), char('}'))(i),
        b',' => value(Lexeme::Punct(TokenKind::Comma), char(','))(i),
        _ => value(Lexeme::Word, take_while1(is_word_char))(i),
    }
}

/// Splits `src` into tokens. Bad characters and unterminated strings become diagnostics and
/// lexing goes on after them; the token list always ends with [`TokenKind::Eof`].
pub fn tokenize<'a>(file: FileId, src: &'a str, diags: &mut Vec<Diagnostic>) -> Vec<Token<'a>> {
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
                    Lexeme::Word => (TokenKind::Word, Cow::Borrowed(&src[start..end])),
                    Lexeme::Str(s) => (TokenKind::Str, s),
                    Lexeme::Punct(k) => (k, Cow::Borrowed(&src[start..end])),
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
        text: Cow::Borrowed(""),
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
        t.into_iter()
            .map(|t| (t.kind, t.text.into_owned()))
            .collect()
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
    fn only_strings_with_escapes_are_copied() {
        let mut d = Vec::new();
        let t = tokenize(FileId(0), r#"word "plain" "" "esc\"aped""#, &mut d);
        assert!(d.is_empty(), "{d:?}");
        let owned: Vec<bool> = t.iter().map(|t| matches!(t.text, Cow::Owned(_))).collect();
        assert_eq!(owned, [false, false, false, true, false]);
        assert_eq!(t[3].text, "esc\"aped");
    }

    #[test]
    fn bad_characters_are_reported_and_skipped() {
        let mut d = Vec::new();
        let t = tokenize(FileId(0), "a ; b \"open\nc", &mut d);
        assert_eq!(d.len(), 2);
        assert_eq!(t.iter().filter(|t| t.kind == TokenKind::Word).count(), 3);
    }
}
