//! `dpuflow trace`: each packet's walk through the pipeline, pipe by pipe, with the entry
//! that matched, the actions that ran and the packet's fate.

use crate::engine::parse::{self, TunnelPorts, L3};
use crate::engine::{Observer, PacketBuf, Verdict};
use crate::firewall::conntrack::Lookup;
use crate::ir::{PipeId, Program};
use crate::wire::ethernet::ethertype;
use crate::wire::{arp, be16, ip_proto};
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

/// Writes a trace of every packet, or of one (1-based `only`).
#[derive(Debug)]
pub struct Tracer<'p> {
    program: &'p Program,
    names: Vec<Vec<String>>,
    only: Option<u64>,
    count: u64,
    pub out: String,
}

impl<'p> Tracer<'p> {
    pub fn new(program: &'p Program, only: Option<u64>) -> Tracer<'p> {
        Tracer {
            program,
            names: program
                .pipes
                .iter()
                .map(crate::ir::Pipe::entry_names)
                .collect(),
            only,
            count: 0,
            out: String::new(),
        }
    }

    fn on(&self) -> bool {
        self.only.is_none_or(|n| n == self.count)
    }
}

impl Observer for Tracer<'_> {
    fn begin(&mut self, pkt: &PacketBuf) {
        self.count += 1;
        if self.on() {
            let port = &self.program.port(pkt.port).name;
            let _ = writeln!(
                self.out,
                "packet {}: in_port {port}, {} bytes: {}",
                self.count,
                pkt.len(),
                summary(pkt.data())
            );
        }
    }

    fn pipe(&mut self, pipe: PipeId) {
        if self.on() {
            let _ = writeln!(self.out, "  pipe {}", self.program.pipe(pipe).name);
        }
    }

    fn entry(&mut self, pipe: PipeId, entry: Option<usize>) {
        if self.on() {
            let line = match entry {
                Some(i) => format!("    match {}", self.names[pipe.index()][i]),
                None => "    no match: default".to_owned(),
            };
            let _ = writeln!(self.out, "{line}");
        }
    }

    fn action(&mut self, pipe: PipeId, entry: Option<usize>, index: usize) {
        if self.on() {
            let p = self.program.pipe(pipe);
            let list = match entry {
                Some(i) => p.body.action_list(i),
                None => Some(&p.miss),
            };
            if let Some(a) = list.and_then(|l| l.0.get(index)) {
                let _ = writeln!(self.out, "      {}", self.program.describe(a));
            }
        }
    }

    fn conntrack(&mut self, zone: u16, l: &Lookup) {
        if self.on() {
            let state = l.state.name();
            let why = l
                .invalid
                .map(|w| format!(" ({}: {})", w.name(), w.describe()))
                .unwrap_or_default();
            let _ = writeln!(self.out, "      conntrack zone {zone}: {state}{why}");
        }
    }

    fn verdict(&mut self, v: Verdict, pkt: &PacketBuf) {
        if self.on() {
            let fate = match v {
                Verdict::Forward(p) => format!(
                    "forwarded to {}, {} bytes: {}",
                    self.program.port(p).name,
                    pkt.len(),
                    summary(pkt.data())
                ),
                Verdict::Drop(r) => format!("dropped: {} ({})", r.name(), r.describe()),
                Verdict::Told(p, r) => format!(
                    "dropped: {}; its sender told so out of {}, {} bytes: {}",
                    r.name(),
                    self.program.port(p).name,
                    pkt.len(),
                    summary(pkt.data())
                ),
                Verdict::Service(s) => format!(
                    "queued to service {}",
                    self.program.services[s.index()].name
                ),
            };
            let _ = writeln!(self.out, "  => {fate}");
        }
    }
}

/// One line about a frame: addresses, protocol, ports, tunnel.
pub fn summary(frame: &[u8]) -> String {
    let tunnels = TunnelPorts::default();
    let meta = match parse::parse(frame, &tunnels) {
        Ok(m) => m,
        Err(r) => return format!("unparsable ({})", r.name()),
    };
    let mut s = layers(frame, &meta.outer);
    if let Some(t) = meta.tunnel {
        let _ = write!(
            s,
            " {} vni {} [{}]",
            t.kind.name(),
            t.vni,
            layers(frame, &meta.inner)
        );
    }
    s
}

fn layers(frame: &[u8], l: &parse::Layers) -> String {
    let l3 = usize::from(l.l3);
    let (src, dst) = match l.l3_kind {
        L3::V4 => (
            Ipv4Addr::from(<[u8; 4]>::try_from(&frame[l3 + 12..l3 + 16]).unwrap_or_default())
                .to_string(),
            Ipv4Addr::from(<[u8; 4]>::try_from(&frame[l3 + 16..l3 + 20]).unwrap_or_default())
                .to_string(),
        ),
        L3::V6 => (
            Ipv6Addr::from(<[u8; 16]>::try_from(&frame[l3 + 8..l3 + 24]).unwrap_or_default())
                .to_string(),
            Ipv6Addr::from(<[u8; 16]>::try_from(&frame[l3 + 24..l3 + 40]).unwrap_or_default())
                .to_string(),
        ),
        L3::None => {
            let arp = (l.ethertype == ethertype::ARP)
                .then(|| arp::Packet::new_checked(&frame[l3..]).ok())
                .flatten();
            return match arp.map(|p| arp::Repr::parse(&p)) {
                Some(a) if a.op == arp::op::REQUEST => {
                    format!("ARP who-has {} tell {}", a.tpa, a.spa)
                }
                Some(a) if a.op == arp::op::REPLY => {
                    let mac = a.sha.map(|b| format!("{b:02x}")).join(":");
                    format!("ARP {} is-at {mac}", a.spa)
                }
                _ => format!("ethertype {:#06x}", l.ethertype),
            };
        }
    };
    let l4 = usize::from(l.l4);
    let what = match l.proto {
        ip_proto::TCP if l.l4_ok => format!("TCP {} > {}", be16(frame, l4), be16(frame, l4 + 2)),
        ip_proto::UDP if l.l4_ok => format!("UDP {} > {}", be16(frame, l4), be16(frame, l4 + 2)),
        ip_proto::ICMP | ip_proto::ICMPV6 if l.l4_ok => {
            format!("ICMP type {} code {}", frame[l4], frame[l4 + 1])
        }
        p if l.fragment => format!("protocol {p} fragment"),
        p => format!("protocol {p}"),
    };
    format!("{src} > {dst} {what}")
}
