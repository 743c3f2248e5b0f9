//! Lowering of rules' matches: fields, and the values, prefixes, ranges and patterns
//! they are matched against.

use super::Lowerer;
use crate::ir::*;
use crate::lang::ast::{self, MatchValue, Word};
use crate::lang::diag::did_you_mean;
use crate::lang::value;
use std::borrow::Cow;

impl Lowerer<'_> {
    pub(super) fn field(&mut self, w: &Word) -> Option<Field> {
        if let Some(f) = Field::parse(&w.text) {
            return Some(f);
        }
        // A tunnel's own header (`vxlan.vni`) is matched outside the packet it carries:
        // the nearest name of another field would be no help.
        if let Some(outer) = w
            .text
            .strip_prefix("inner.")
            .filter(|f| Field::parse(f).is_some())
        {
            self.err(w.span, format!("`{outer}` has no inner copy"))
                .hint = Some(format!("write `{outer}`"));
            return None;
        }
        let names: Vec<String> = Field::all_names().collect();
        let hint = did_you_mean(&w.text, names.iter().map(String::as_str));
        self.err(w.span, format!("unknown field `{}`", w.text)).hint = hint;
        None
    }

    pub(super) fn field_match(&mut self, m: &ast::Match) -> Option<FieldMatch> {
        let field = self.field(&m.field)?;
        let pattern = match &m.value {
            MatchValue::One(w) => self.pattern(field, w)?,
            MatchValue::Set(ws, _) => {
                let ps: Option<Vec<Pattern>> = ws.iter().map(|w| self.pattern(field, w)).collect();
                let mut ps = ps?;
                if ps.len() == 1 {
                    ps.pop().expect("one element")
                } else {
                    Pattern::Any(ps)
                }
            }
        };
        Some(FieldMatch { field, pattern })
    }

    fn out_of_range(&mut self, field: Field, w: &Word, v: u128) {
        let max = field.kind().full_mask();
        let what = match field.id {
            FieldId::VxlanVni | FieldId::GeneveVni => "VNI".to_owned(),
            FieldId::IpDscp => "DSCP".to_owned(),
            _ => "value".to_owned(),
        };
        self.err(
            w.span,
            format!("{what} {v} is out of range for `{field}` (0-{max})"),
        );
    }

    /// An integer within the field's width.
    fn int_value(&mut self, field: Field, w: &Word, text: &str) -> Option<u128> {
        let Some(v) = value::integer(text) else {
            let hint = if value::is_negative_number(text) {
                "values are never negative"
            } else {
                "write a decimal or 0x-hexadecimal integer"
            };
            self.err(w.span, format!("invalid value `{text}` for `{field}`"))
                .hint = Some(hint.into());
            return None;
        };
        if v > field.kind().full_mask() {
            self.out_of_range(field, w, v);
            return None;
        }
        Some(v)
    }

    /// An address, optionally `/LEN`; returns the value and prefix length.
    pub(super) fn address(
        &mut self,
        field: Field,
        w: &Word,
        allow_prefix: bool,
    ) -> Option<(u128, u8)> {
        let kind = field.kind();
        let (addr, len) = match value::prefix(&w.text) {
            Some((a, l)) if allow_prefix => (a, Some(l)),
            Some(_) => {
                self.err(
                    w.span,
                    format!("`{field}` takes a single address here, not a prefix"),
                );
                return None;
            }
            None => (w.as_str(), None),
        };
        let (v, bits) = match kind {
            // The other family is parsed only to explain an error.
            ValueKind::Ipv4 => match value::ipv4(addr).ok_or_else(|| value::ipv6(addr)) {
                Ok(a) => (u32::from(a) as u128, 32),
                Err(Some(_)) => {
                    let v6 = format!("ipv6.{}", &field.info().name[5..]);
                    self.err(
                        w.span,
                        format!("`{field}` takes an IPv4 address, found IPv6 `{addr}`"),
                    )
                    .hint = Some(format!(
                        "match IPv6 with `{}{v6}`",
                        if field.inner { "inner." } else { "" }
                    ));
                    return None;
                }
                Err(None) => {
                    self.err(
                        w.span,
                        format!("invalid IPv4 address `{addr}` for `{field}`"),
                    );
                    return None;
                }
            },
            _ => match value::ipv6(addr).ok_or_else(|| value::ipv4(addr)) {
                Ok(a) => (u128::from(a), 128),
                Err(Some(_)) => {
                    let v4 = format!("ipv4.{}", &field.info().name[5..]);
                    self.err(
                        w.span,
                        format!("`{field}` takes an IPv6 address, found IPv4 `{addr}`"),
                    )
                    .hint = Some(format!(
                        "match IPv4 with `{}{v4}`",
                        if field.inner { "inner." } else { "" }
                    ));
                    return None;
                }
                Err(None) => {
                    self.err(
                        w.span,
                        format!("invalid IPv6 address `{addr}` for `{field}`"),
                    );
                    return None;
                }
            },
        };
        let len = len.unwrap_or(bits);
        if len > bits {
            let fam = if bits == 32 { "an IPv4" } else { "an IPv6" };
            self.err(
                w.span,
                format!("prefix length {len} is out of range for {fam} address (0-{bits})"),
            );
            return None;
        }
        Some((v, len as u8))
    }

    /// A single value of the field's kind (no prefixes, ranges or masks).
    pub(super) fn exact_value(&mut self, field: Field, w: &Word) -> Option<u128> {
        match field.kind() {
            ValueKind::Ipv4 | ValueKind::Ipv6 => self.address(field, w, false).map(|(v, _)| v),
            ValueKind::Mac => self.mac(field, w),
            ValueKind::Port => self.resolve_port(w).map(u128::from),
            ValueKind::CtState => self.names_value(field, w, CT_STATE_NAMES),
            ValueKind::TcpFlags => value::integer(&w.text)
                .filter(|&v| v <= 0xff)
                .or_else(|| value::bit_names(&w.text, TCP_FLAG_NAMES))
                .or_else(|| {
                    self.err(w.span, format!("invalid TCP flags `{}`", w.text))
                        .hint =
                        Some("write flag names joined by `+` (`syn+ack`) or a number".into());
                    None
                }),
            ValueKind::Int { .. } => self.int_value(field, w, &w.text),
        }
    }

    /// A MAC address, `what` naming its place for the error (a field, an action, a key).
    pub(super) fn mac(&mut self, what: impl std::fmt::Display, w: &Word) -> Option<u128> {
        match value::mac(&w.text) {
            Some(b) => Some(b.iter().fold(0u128, |acc, &x| acc << 8 | u128::from(x))),
            None => {
                self.err(
                    w.span,
                    format!("invalid MAC address `{}` for `{what}`", w.text),
                )
                .hint = Some("write six hex bytes: 02:00:00:00:00:01".into());
                None
            }
        }
    }

    fn names_value(&mut self, field: Field, w: &Word, names: &[(&str, u128)]) -> Option<u128> {
        if let Some(&(_, v)) = names.iter().find(|(n, _)| *n == w.text) {
            return Some(v);
        }
        let hint = did_you_mean(&w.text, names.iter().map(|(n, _)| *n)).unwrap_or_else(|| {
            format!(
                "values are: {}",
                names.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            )
        });
        self.err(w.span, format!("invalid `{field}` value `{}`", w.text))
            .hint = Some(hint);
        None
    }

    pub(super) fn pattern(&mut self, field: Field, w: &Word) -> Option<Pattern> {
        let kind = field.kind();
        match kind {
            ValueKind::Ipv4 | ValueKind::Ipv6 => {
                if let Some((lo, hi)) = value::range(&w.text)
                    .filter(|_| kind == ValueKind::Ipv4 || !w.text.contains('/'))
                {
                    let lo_w = Word {
                        text: Cow::Borrowed(lo),
                        span: w.span,
                        quoted: w.quoted,
                    };
                    let hi_w = Word {
                        text: Cow::Borrowed(hi),
                        span: w.span,
                        quoted: w.quoted,
                    };
                    let lo = self.address(field, &lo_w, false)?.0;
                    let hi = self.address(field, &hi_w, false)?.0;
                    return self.range(field, w, lo, hi);
                }
                let (v, len) = self.address(field, w, true)?;
                Some(Pattern::prefix(v, len, kind))
            }
            ValueKind::Int { .. } => {
                if let Some((v, m)) = value::masked(&w.text) {
                    let (v, m) = (
                        self.int_value(field, w, &v.to_string())?,
                        self.int_value(field, w, &m.to_string())?,
                    );
                    return Some(Pattern::Masked {
                        value: v & m,
                        mask: m,
                    });
                }
                if let Some((lo, hi)) = value::range(&w.text) {
                    let lo = self.int_value(field, w, lo)?;
                    let hi = self.int_value(field, w, hi)?;
                    return self.range(field, w, lo, hi);
                }
                Some(Pattern::exact(self.int_value(field, w, &w.text)?, kind))
            }
            ValueKind::TcpFlags => {
                // `syn` means "SYN set"; `syn/syn+ack` means "SYN set and ACK clear".
                let (v, m) = match w.text.split_once('/') {
                    Some((v, m)) => {
                        let vw = Word {
                            text: Cow::Borrowed(v),
                            span: w.span,
                            quoted: w.quoted,
                        };
                        let mw = Word {
                            text: Cow::Borrowed(m),
                            span: w.span,
                            quoted: w.quoted,
                        };
                        (self.exact_value(field, &vw)?, self.exact_value(field, &mw)?)
                    }
                    None => {
                        let v = self.exact_value(field, w)?;
                        (v, v)
                    }
                };
                if v & !m != 0 {
                    self.err(
                        w.span,
                        format!("TCP flags `{}` set bits outside the mask", w.text),
                    );
                    return None;
                }
                Some(Pattern::Masked { value: v, mask: m })
            }
            _ => Some(Pattern::exact(self.exact_value(field, w)?, kind)),
        }
    }

    pub(super) fn range(&mut self, field: Field, w: &Word, lo: u128, hi: u128) -> Option<Pattern> {
        if lo > hi {
            self.err(
                w.span,
                format!(
                    "range `{}` of `{field}` is empty: its low end is above its high end",
                    w.text
                ),
            )
            .hint = Some("write ranges as `LOW-HIGH`".into());
            return None;
        }
        Some(Pattern::Range { lo, hi })
    }

    // ---- actions -------------------------------------------------------------------
}
