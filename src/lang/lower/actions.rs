//! Lowering of rules' actions, tunnel encapsulations among them.

use super::{matches_tunnel, opt_value, Lowerer, PipeCtx};
use crate::ir::*;
use crate::lang::ast::{self, Opt, Word};
use crate::lang::diag::{Diagnostic, Span};
use crate::lang::value;
use std::net::IpAddr;

/// The `i`th argument of action `a`, if it has one.
fn arg<'o, 'a>(a: &'o ast::Action<'a>, i: usize) -> Option<&'o Word<'a>> {
    a.args.get(i)
}

/// Whether an action of this name ends the list: the packet leaves the pipe.
fn is_terminal_name(name: &str) -> bool {
    matches!(name, "fwd" | "goto" | "drop" | "to")
}

/// A MAC address's six bytes, from its value as matched (the low 48 bits).
fn mac_bytes(v: u128) -> [u8; 6] {
    let b = v.to_be_bytes();
    b[10..16].try_into().expect("six bytes")
}

impl Lowerer<'_> {
    /// Lowers an action list and checks it: one terminal action, last; encap followed by
    /// a forward; decap only of a tunnel the rule matches.
    pub(super) fn actions(
        &mut self,
        list: &[ast::Action],
        owner: Span,
        matched: &[FieldMatch],
        ctx: &mut PipeCtx,
    ) -> Option<ActionList> {
        let mut out = Vec::with_capacity(list.len());
        let mut ok = true;
        let mut terminal: Option<&ast::Action> = None;
        let mut encap: Option<&ast::Action> = None;
        for a in list {
            if let Some(t) = terminal {
                let msg = if is_terminal_name(&a.name.text) {
                    format!(
                        "conflicting terminal actions: `{}` after `{}`",
                        a.name.text, t.name.text
                    )
                } else {
                    format!("`{}` after `{}` never runs", a.name.text, t.name.text)
                };
                self.err(a.span, msg)
                    .add_note(t.span, "the list ends here")
                    .hint =
                    Some("an action list ends with exactly one of fwd, goto, drop or to".into());
                ok = false;
                break;
            }
            match self.action(a, matched, ctx) {
                Some(action) => {
                    if action.is_terminal() {
                        terminal = Some(a);
                    }
                    if matches!(action, Action::Encap(_)) {
                        encap = Some(a);
                    }
                    out.push(action);
                }
                None => ok = false,
            }
        }
        if !ok {
            return None;
        }
        match (out.last(), encap) {
            (Some(t), _) if !t.is_terminal() => {
                self.err(owner, "action list has no terminal action").hint =
                    Some("end it with `fwd PORT`, `goto PIPE`, `drop` or `to SERVICE`".into());
                None
            }
            (Some(Action::Drop | Action::ToService(_)), Some(e)) => {
                self.err(
                    e.span,
                    format!(
                        "`{}` without a forward: the encapsulated packet is never sent",
                        e.name.text
                    ),
                )
                .hint = Some("end the list with `fwd PORT` or `goto PIPE`".into());
                None
            }
            _ => Some(ActionList(out)),
        }
    }

    pub(super) fn action(
        &mut self,
        a: &ast::Action,
        matched: &[FieldMatch],
        ctx: &mut PipeCtx,
    ) -> Option<Action> {
        let name = a.name.as_str();
        Some(match name {
            "fwd" | "mirror" => {
                let id = PortId(self.resolve_port(arg(a, 0)?)?);
                if name == "fwd" {
                    Action::Fwd(id)
                } else {
                    Action::Mirror(id)
                }
            }
            "goto" => {
                let w = arg(a, 0)?;
                let id = self.resolve(|l| &l.pipes, "pipe", w)?;
                ctx.gotos.push((id, a.span));
                Action::Goto(PipeId(id))
            }
            "meter" => Action::Meter(MeterId(self.resolve(|l| &l.meters, "meter", arg(a, 0)?)?)),
            "to" => {
                ctx.to_services.push(a.span);
                Action::ToService(ServiceId(self.resolve(
                    |l| &l.services,
                    "service",
                    arg(a, 0)?,
                )?))
            }
            "drop" => Action::Drop,
            "count" => Action::Count,
            "mark" => Action::Mark(self.int_in(arg(a, 0)?, "mark", 0, u32::MAX.into())? as u32),
            "dec" => {
                let w = arg(a, 0)?;
                if w.text != "ttl" && w.text != "hop_limit" {
                    self.err(w.span, format!("cannot decrement `{}`", w.text))
                        .hint = Some("write `dec ttl` (IPv4 TTL or IPv6 hop limit)".into());
                    return None;
                }
                // Worked out for the whole program (`Program::note_arrivals`).
                Action::DecTtl {
                    seen: Arrival::Changed,
                }
            }
            "clamp" => {
                let w = arg(a, 0)?;
                if w.text != "tcp.mss" {
                    self.err(w.span, format!("cannot clamp `{}`", w.text)).hint =
                        Some("write `clamp tcp.mss N` or `clamp tcp.mss mtu` (the MSS option of TCP SYN segments)".into());
                    return None;
                }
                let to = arg(a, 1)?;
                if to.text == "mtu" {
                    Action::ClampMssToMtu
                } else {
                    // RFC 9293 §3.7.1: 536 is the MSS every IPv4 host takes.
                    Action::ClampMss(self.int_in(to, "MSS", 536, 65535)? as u16)
                }
            }
            "arp.reply" | "nd.advert" => {
                self.check_answers_a_request(a, matched);
                let mac = mac_bytes(self.mac(name, arg(a, 0)?)?);
                if name == "arp.reply" {
                    Action::ArpReply(mac)
                } else {
                    Action::NdAdvert {
                        mac,
                        router: a.args.len() > 1,
                    }
                }
            }
            "echo.reply" => {
                self.check_answers_a_request(a, matched);
                Action::EchoReply
            }
            "set" => {
                let fw = arg(a, 0)?;
                let field = self.field(fw)?;
                if !field.info().settable {
                    let settable: Vec<&str> = FIELDS
                        .iter()
                        .filter(|f| f.settable)
                        .map(|f| f.name)
                        .collect();
                    self.err(fw.span, format!("`{field}` cannot be set")).hint =
                        Some(format!("settable fields: {}", settable.join(", ")));
                    return None;
                }
                let value = self.exact_value(field, arg(a, 1)?)?;
                Action::Set { field, value }
            }
            "vlan.push" => {
                let (vid, pcp) = match &a.block {
                    Some(opts) => {
                        let mut vid = None;
                        let mut pcp = 0;
                        for o in opts {
                            let w = self.single(o)?;
                            match o.key.as_str() {
                                "id" => vid = Some(self.int_in(w, "VLAN id", 0, 4095)? as u16),
                                _ => pcp = self.int_in(w, "VLAN priority", 0, 7)? as u8,
                            }
                        }
                        let Some(vid) = vid else {
                            self.err(a.name.span, "`vlan.push` needs an `id`");
                            return None;
                        };
                        (vid, pcp)
                    }
                    None => (self.int_in(arg(a, 0)?, "VLAN id", 0, 4095)? as u16, 0),
                };
                Action::VlanPush { vid, pcp }
            }
            "vlan.pop" => Action::VlanPop,
            "vxlan.encap" => Action::Encap(Box::new(self.encap(a, Tunnel::Vxlan)?)),
            "geneve.encap" => Action::Encap(Box::new(self.encap(a, Tunnel::Geneve)?)),
            "vxlan.decap" | "geneve.decap" => {
                let tunnel = if name == "vxlan.decap" {
                    Tunnel::Vxlan
                } else {
                    Tunnel::Geneve
                };
                if !matches_tunnel(matched, tunnel) {
                    let vni = format!("{}.vni", tunnel.name());
                    self.err(a.span, format!("`{name}` of a tunnel this rule does not match")).hint = Some(format!(
                        "match `{vni}` or `udp.dst {}` in the same rule so only {} packets are decapsulated",
                        tunnel.default_port(),
                        tunnel.name().to_uppercase()
                    ));
                    return None;
                }
                Action::Decap(tunnel)
            }
            "ct.commit" => {
                let zone = match a.args.get(1) {
                    Some(w) => self.int_in(w, "zone", 0, 65535)? as u16,
                    None => 0,
                };
                Action::CtCommit { zone }
            }
            _ => unreachable!("the parser accepts only known actions"),
        })
    }

    fn encap(&mut self, a: &ast::Action, tunnel: Tunnel) -> Option<Encap> {
        let opts = a.block.as_deref().unwrap_or_default();
        self.check_repeats(opts, &["option"]);
        let mut vni = None;
        let mut src: Option<IpAddr> = None;
        let mut dst: Option<IpAddr> = None;
        let mut smac = None;
        let mut dmac = None;
        let mut udp_dst = tunnel.default_port();
        let mut ttl = 64;
        let mut dscp = OuterDscp::Fixed(0);
        let mut options = Vec::new();
        let mut ok = true;
        for o in opts {
            if o.key.text == "option" {
                match self.geneve_option(o, tunnel) {
                    Some(opt) => options.push(opt),
                    None => ok = false,
                }
                continue;
            }
            let Some(w) = self.single(o) else {
                ok = false;
                continue;
            };
            let r = match o.key.as_str() {
                "vni" => self
                    .int_in(w, "VNI", 0, (1 << 24) - 1)
                    .map(|v| vni = Some(v as u32)),
                "src" | "dst" => self
                    .parsed(w, "IP address", "write an IPv4 or IPv6 address", |t| {
                        t.parse::<IpAddr>().ok()
                    })
                    .map(|ip| {
                        if o.key.text == "src" {
                            src = Some(ip)
                        } else {
                            dst = Some(ip)
                        }
                    }),
                "smac" => self.mac("smac", w).map(|m| smac = Some(m)),
                "dmac" => self.mac("dmac", w).map(|m| dmac = Some(m)),
                "dport" => self
                    .int_in(w, "UDP port", 1, 65535)
                    .map(|p| udp_dst = p as u16),
                "ttl" => self.int_in(w, "TTL", 1, 255).map(|t| ttl = t as u8),
                "dscp" if w.text == "inherit" => {
                    dscp = OuterDscp::Inherit;
                    Some(())
                }
                "dscp" => self
                    .parsed_if(
                        w,
                        ("DSCP", "write 0 to 63, or `inherit` for the inner packet's"),
                        value::integer,
                        |d| d <= 63,
                        |d| format!("DSCP {d} is out of range (0-63)"),
                    )
                    .map(|d| dscp = OuterDscp::Fixed(d as u8)),
                _ => unreachable!("the parser accepts only encap keys"),
            };
            ok &= r.is_some();
        }
        for (key, missing) in [
            ("vni", vni.is_none()),
            ("src", src.is_none()),
            ("dst", dst.is_none()),
            ("smac", smac.is_none()),
            ("dmac", dmac.is_none()),
        ] {
            if missing && ok {
                self.err(a.name.span, format!("`{}` needs `{key}`", a.name.text)).hint =
                    Some("encapsulation takes vni, src, dst, smac and dmac (dport, ttl, dscp and option are optional)".into());
                ok = false;
            }
        }
        if !ok {
            return None;
        }
        let (src, dst) = (src?, dst?);
        if src.is_ipv4() != dst.is_ipv4() {
            let span = opt_value(opts, "dst").map_or(a.span, |o| o.values[0].span);
            self.err(span, "outer `src` and `dst` are of different IP versions");
            return None;
        }
        let total: usize = options
            .iter()
            .map(|o: &GeneveOption| 4 + o.data.len())
            .sum();
        if total > 252 {
            self.err(
                a.span,
                format!("Geneve options take {total} bytes; the header allows 252 (RFC 8926 §3.4)"),
            );
            return None;
        }
        Some(Encap {
            tunnel,
            vni: vni?,
            src,
            dst,
            smac: mac_bytes(smac?),
            dmac: mac_bytes(dmac?),
            udp_dst,
            ttl,
            dscp,
            options,
        })
    }

    /// `option CLASS TYPE DATA` (RFC 8926 §3.5); a type with its top bit set is critical.
    fn geneve_option(&mut self, o: &Opt, tunnel: Tunnel) -> Option<GeneveOption> {
        if tunnel != Tunnel::Geneve {
            self.err(o.key.span, "VXLAN has no options").hint =
                Some("options belong to `geneve.encap`".into());
            return None;
        }
        let [class, kind, data_word] = &o.values[..] else {
            unreachable!("the parser takes a class, a type and data")
        };
        let class = self.int_in(class, "option class", 0, 0xffff)? as u16;
        let kind = self.int_in(kind, "option type", 0, 0xff)? as u8;
        let data = self.parsed(
            data_word,
            "option data",
            "write 0x and a multiple of 8 hex digits",
            value::hex_bytes,
        )?;
        if data.len() % 4 != 0 || data.len() > 124 {
            self.err(
                data_word.span,
                format!(
                    "option data is {} bytes; it must be a multiple of 4, at most 124",
                    data.len()
                ),
            );
            return None;
        }
        Some(GeneveOption {
            class,
            kind,
            critical: kind & 0x80 != 0,
            data,
        })
    }

    /// Warns where an answering action's rule does not match the request it answers
    /// (`arp.op 1`, `icmp6.type 135`, `icmp.type 8` or `icmp6.type 128`, outside or
    /// inside a tunnel): every other frame the rule takes is dropped as unanswerable.
    fn check_answers_a_request(&mut self, a: &ast::Action, matched: &[FieldMatch]) {
        let (requests, write): (&[(FieldId, u128)], &str) = match a.name.as_str() {
            "arp.reply" => (&[(FieldId::ArpOp, 1)], "`arp.op 1`"),
            "nd.advert" => (&[(FieldId::Icmp6Type, 135)], "`icmp6.type 135`"),
            _ => (
                &[(FieldId::IcmpType, 8), (FieldId::Icmp6Type, 128)],
                "`icmp.type 8` or `icmp6.type 128`",
            ),
        };
        let answers = matched.iter().any(|m| {
            requests
                .iter()
                .any(|&(id, v)| m.field.id == id && m.pattern == Pattern::exact(v, m.field.kind()))
        });
        if !answers {
            self.diags.push(
                Diagnostic::warning(
                    a.span,
                    format!(
                        "`{}` in a rule that does not match {write}: the other frames it \
                         takes are dropped as unanswerable",
                        a.name.text
                    ),
                )
                .hint(format!("match {write} in the same rule")),
            );
        }
    }

    // ---- whole-pipeline checks -----------------------------------------------------
}
