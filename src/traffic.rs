//! Synthetic traffic for `dpuflow bench`: packets built to hit each entry of a root pipe,
//! spread over a number of flows, as frames cycled through or as TCP conversations.

use crate::engine::PacketBuf;
use crate::ir::{FieldId, FieldMatch, Pattern, PipeBody, PortId, Program, Tunnel};
use crate::wire::ethernet::{self, ethertype};
use crate::wire::{be16, checksum, ip_proto, ipv4, ipv6, put16, put32, tcp};
use std::net::Ipv4Addr;

/// Headers of one synthetic packet.
#[derive(Debug, Clone)]
struct Spec {
    src_mac: [u8; 6],
    dst_mac: [u8; 6],
    vlan: Option<u16>,
    v6: bool,
    src: u128,
    dst: u128,
    dscp: u8,
    ttl: u8,
    proto: u8,
    sport: u16,
    dport: u16,
    tcp_flags: u8,
    icmp: (u8, u8),
    tunnel: Option<(Tunnel, u32, Box<Spec>)>,
    /// Fields the entry fixes; flows vary only the others.
    fixed_src: bool,
    fixed_sport: bool,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            src_mac: [0x02, 0, 0, 0, 0, 0x10],
            dst_mac: [0x02, 0, 0, 0, 0, 0x20],
            vlan: None,
            v6: false,
            src: u128::from(u32::from(Ipv4Addr::new(10, 0, 0, 1))),
            dst: u128::from(u32::from(Ipv4Addr::new(10, 0, 0, 2))),
            dscp: 0,
            ttl: 64,
            proto: ip_proto::UDP,
            sport: 1024,
            dport: 5001,
            tcp_flags: 0x10,
            icmp: (8, 0),
            tunnel: None,
            fixed_src: false,
            fixed_sport: false,
        }
    }
}

/// A value the pattern matches.
fn sample(p: &Pattern) -> u128 {
    match p {
        Pattern::Masked { value, .. } => *value,
        Pattern::Range { lo, .. } => *lo,
        Pattern::Any(ps) => ps.first().map_or(0, sample),
    }
}

fn v6_of(v4: u128) -> u128 {
    // 2001:db8::/96 plus the IPv4 address, for IPv6 fields left unset.
    0x2001_0db8_0000_0000_0000_0000_0000_0000 | (v4 & 0xffff_ffff)
}

impl Spec {
    fn apply(&mut self, m: &FieldMatch) {
        if m.field.inner {
            let inner = match &mut self.tunnel {
                Some((_, _, inner)) => inner,
                None => {
                    self.set_tunnel(Tunnel::Vxlan, 0);
                    &mut self.tunnel.as_mut().expect("just set").2
                }
            };
            let outer_field = FieldMatch {
                field: crate::ir::Field {
                    id: m.field.id,
                    inner: false,
                },
                pattern: m.pattern.clone(),
            };
            inner.apply(&outer_field);
            return;
        }
        let v = sample(&m.pattern);
        match m.field.id {
            FieldId::EthSrc => self.src_mac = mac(v),
            FieldId::EthDst => self.dst_mac = mac(v),
            FieldId::VlanId => self.vlan = Some(v as u16),
            FieldId::Ipv4Src => {
                self.v6 = false;
                self.src = v;
                self.fixed_src = m.pattern == Pattern::exact(v, m.field.kind());
            }
            FieldId::Ipv4Dst => {
                self.v6 = false;
                self.dst = v;
            }
            FieldId::Ipv6Src | FieldId::Ipv6Dst => {
                if !self.v6 {
                    self.v6 = true;
                    self.src = v6_of(self.src);
                    self.dst = v6_of(self.dst);
                }
                if m.field.id == FieldId::Ipv6Src {
                    self.src = v;
                    self.fixed_src = m.pattern == Pattern::exact(v, m.field.kind());
                } else {
                    self.dst = v;
                }
            }
            FieldId::IpProto => self.proto = v as u8,
            FieldId::IpDscp => self.dscp = v as u8,
            FieldId::IpTtl => self.ttl = (v as u8).max(2),
            FieldId::TcpSrc
            | FieldId::TcpDst
            | FieldId::UdpSrc
            | FieldId::UdpDst
            | FieldId::L4Src
            | FieldId::L4Dst => {
                match m.field.id {
                    FieldId::TcpSrc | FieldId::TcpDst => self.proto = ip_proto::TCP,
                    FieldId::UdpSrc | FieldId::UdpDst => self.proto = ip_proto::UDP,
                    _ if !matches!(self.proto, ip_proto::TCP | ip_proto::UDP) => {
                        self.proto = ip_proto::UDP
                    }
                    _ => {}
                }
                if matches!(
                    m.field.id,
                    FieldId::TcpSrc | FieldId::UdpSrc | FieldId::L4Src
                ) {
                    self.sport = v as u16;
                    self.fixed_sport = true;
                } else {
                    self.dport = v as u16;
                }
            }
            FieldId::TcpFlags => {
                self.proto = ip_proto::TCP;
                self.tcp_flags = v as u8;
            }
            FieldId::IcmpType | FieldId::IcmpCode => {
                self.v6 = false;
                self.proto = ip_proto::ICMP;
                if m.field.id == FieldId::IcmpType {
                    self.icmp.0 = v as u8;
                } else {
                    self.icmp.1 = v as u8;
                }
            }
            FieldId::Icmp6Type | FieldId::Icmp6Code => {
                if !self.v6 {
                    self.v6 = true;
                    self.src = v6_of(self.src);
                    self.dst = v6_of(self.dst);
                }
                self.proto = ip_proto::ICMPV6;
                if m.field.id == FieldId::Icmp6Type {
                    self.icmp.0 = v as u8;
                } else {
                    self.icmp.1 = v as u8;
                }
            }
            FieldId::VxlanVni => self.set_tunnel(Tunnel::Vxlan, v as u32),
            FieldId::GeneveVni => self.set_tunnel(Tunnel::Geneve, v as u32),
            _ => {}
        }
    }

    fn set_tunnel(&mut self, kind: Tunnel, vni: u32) {
        self.proto = ip_proto::UDP;
        self.dport = kind.default_port();
        let inner = self.tunnel.take().map(|(_, _, i)| i).unwrap_or_default();
        self.tunnel = Some((kind, vni, inner));
    }

    /// The frame, padded with zeros to at least `size` bytes.
    fn emit(&self, size: usize, out: &mut Vec<u8>) {
        let start = out.len();
        let l2 = ethernet::HEADER_LEN + if self.vlan.is_some() { 4 } else { 0 };
        out.resize(start + l2, 0);
        ethernet::Repr {
            src: self.src_mac,
            dst: self.dst_mac,
            ethertype: if self.vlan.is_some() {
                ethertype::VLAN
            } else if self.v6 {
                ethertype::IPV6
            } else {
                ethertype::IPV4
            },
        }
        .emit(&mut out[start..]);
        if let Some(vid) = self.vlan {
            put16(&mut out[start..], 14, vid & 0x0fff);
            put16(
                &mut out[start..],
                16,
                if self.v6 {
                    ethertype::IPV6
                } else {
                    ethertype::IPV4
                },
            );
        }
        let ip_at = out.len();
        let ip_len = if self.v6 {
            ipv6::HEADER_LEN
        } else {
            ipv4::MIN_HEADER_LEN
        };
        out.resize(ip_at + ip_len, 0);
        let l4_at = out.len();
        match self.proto {
            ip_proto::TCP => {
                out.resize(l4_at + 20, 0);
                let t = &mut out[l4_at..];
                put16(t, 0, self.sport);
                put16(t, 2, self.dport);
                t[12] = 5 << 4;
                t[13] = self.tcp_flags;
                put16(t, 14, 65535);
            }
            ip_proto::ICMP | ip_proto::ICMPV6 => {
                out.resize(l4_at + 8, 0);
                out[l4_at] = self.icmp.0;
                out[l4_at + 1] = self.icmp.1;
            }
            _ => {
                out.resize(l4_at + 8, 0);
                put16(&mut out[l4_at..], 0, self.sport);
                put16(&mut out[l4_at..], 2, self.dport);
                if let Some((kind, vni, inner)) = &self.tunnel {
                    let t = out.len();
                    match kind {
                        Tunnel::Vxlan => {
                            out.resize(t + 8, 0);
                            crate::wire::vxlan::Repr { vni: *vni }.emit(&mut out[t..]);
                        }
                        Tunnel::Geneve => {
                            out.resize(t + 8, 0);
                            crate::wire::geneve::Repr {
                                vni: *vni,
                                protocol: ethertype::TEB,
                                options: &[],
                                critical: false,
                            }
                            .emit(&mut out[t..]);
                        }
                    }
                    inner.emit(size.saturating_sub(out.len() - start), out);
                }
            }
        }
        if out.len() - start < size {
            out.resize(start + size, 0);
        }
        let l4_len = out.len() - l4_at;
        if self.v6 {
            ipv6::Repr {
                src: self.src.to_be_bytes(),
                dst: self.dst.to_be_bytes(),
                next_header: self.proto,
                hop_limit: self.ttl,
                dscp: self.dscp,
                flow_label: 0,
                payload_len: l4_len as u16,
            }
            .emit(&mut out[ip_at..]);
        } else {
            ipv4::Repr {
                src: (self.src as u32).to_be_bytes(),
                dst: (self.dst as u32).to_be_bytes(),
                protocol: self.proto,
                ttl: self.ttl,
                dscp: self.dscp,
                dont_frag: false,
                payload_len: l4_len as u16,
            }
            .emit(&mut out[ip_at..]);
        }
        let seg = &mut out[l4_at..];
        if self.proto == ip_proto::UDP {
            put16(seg, 4, l4_len as u16);
        }
        let ck_at = match self.proto {
            ip_proto::TCP => Some(16),
            ip_proto::UDP if self.v6 => Some(6),
            ip_proto::ICMP | ip_proto::ICMPV6 => Some(2),
            _ => None,
        };
        if let Some(at) = ck_at {
            let pseudo = match (self.v6, self.proto) {
                (_, ip_proto::ICMP) => 0,
                (true, p) => checksum::pseudo_v6(
                    &self.src.to_be_bytes(),
                    &self.dst.to_be_bytes(),
                    p,
                    l4_len as u32,
                ),
                (false, p) => checksum::pseudo_v4(
                    (self.src as u32).to_be_bytes(),
                    (self.dst as u32).to_be_bytes(),
                    p,
                    l4_len as u16,
                ),
            };
            let c = !checksum::fold(checksum::sum(pseudo, seg));
            put16(
                seg,
                at,
                if c == 0 && self.proto == ip_proto::UDP {
                    0xffff
                } else {
                    c
                },
            );
        }
    }

    /// The same entry, flow number `i`: source port and low source-address bits vary
    /// where the entry leaves them free.
    fn flow(&self, i: u32) -> Spec {
        let mut s = self.clone();
        if !s.fixed_sport {
            s.sport = 1024 + (i % 60_000) as u16;
        }
        if !s.fixed_src {
            s.src ^= u128::from(i / 60_000) << 8;
        }
        if let Some((_, _, inner)) = &mut s.tunnel {
            **inner = inner.flow(i);
        }
        s
    }

    /// The packet as a frame of `size` bytes.
    fn frame(&self, size: usize) -> Vec<u8> {
        let mut frame = Vec::with_capacity(size.max(128));
        self.emit(size, &mut frame);
        frame
    }

    /// A packet of the given addresses, ports and protocol (the trace's words).
    fn of_tuple(v6: bool, (src, dst): (u128, u128), ports: (u32, u32), proto: u32) -> Spec {
        Spec {
            v6,
            src,
            dst,
            sport: ports.0 as u16,
            dport: ports.1 as u16,
            proto: proto as u8,
            ..Spec::default()
        }
    }
}

fn mac(v: u128) -> [u8; 6] {
    v.to_be_bytes()[10..].try_into().expect("6 bytes")
}

/// Frames of `size` bytes for the packets of a ClassBench trace, one per line in order
/// (`SRC DST SPORT DPORT PROTO`, IPv4 addresses as integers or IPv6 ones in colon
/// notation, as `dpuflow acl gen-trace` writes and dpdk-test-acl reads), so a rule pipe
/// can be driven by the packets its rule set is measured with.
pub fn from_trace(path: &std::path::Path, size: usize) -> Result<Vec<Vec<u8>>, String> {
    use crate::firewall::acl;
    use std::io::BufRead;
    let join = |w: &[u32]| w.iter().fold(0u128, |a, &x| a << 32 | u128::from(x));
    // IPv6 addresses are written with colons, IPv4 ones as integers: the first line says.
    let mut first = String::new();
    std::fs::File::open(path)
        .map(std::io::BufReader::new)
        .and_then(|mut f| f.read_line(&mut first))
        .map_err(|e| e.to_string())?;
    let packets: Vec<Spec> = if !first.contains(':') {
        acl::load_trace(path)?
            .iter()
            .map(|k| {
                let [src, dst, sport, dport, proto] = k.0;
                Spec::of_tuple(false, (src.into(), dst.into()), (sport, dport), proto)
            })
            .collect()
    } else {
        acl::load_trace_v6(path)?
            .iter()
            .map(|k| {
                let w = &k.0;
                let ports = (w[8], w[9]);
                Spec::of_tuple(true, (join(&w[..4]), join(&w[4..8])), ports, w[10])
            })
            .collect()
    };
    Ok(packets.iter().map(|s| s.frame(size)).collect())
}

/// Packets for `port`'s root pipe: `flows` flows spread round-robin over its entries
/// (its default when it has none). Empty when the port feeds no pipe.
pub fn generate(p: &Program, port: PortId, size: usize, flows: u32) -> Vec<Vec<u8>> {
    frames(&specs(p, port, None, flows), size)
}

/// [`generate`]'s packets, all made for the root pipe's rule named `rule`: an error when
/// it has none of that name.
pub fn generate_for_rule(
    p: &Program,
    port: PortId,
    rule: &str,
    size: usize,
    flows: u32,
) -> Result<Vec<Vec<u8>>, String> {
    let specs = specs(p, port, Some(rule), flows);
    match specs.is_empty() {
        true => Err(no_such_rule(p, port, rule)),
        false => Ok(frames(&specs, size)),
    }
}

fn frames(specs: &[Spec], size: usize) -> Vec<Vec<u8>> {
    specs.iter().map(|s| s.frame(size)).collect()
}

fn no_such_rule(p: &Program, port: PortId, rule: &str) -> String {
    let pipe = p.root_of(port).map(|r| p.pipe(r).name.as_str());
    format!(
        "the root pipe `{}` has no rule `{rule}`",
        pipe.unwrap_or("-")
    )
}

/// The headers of [`generate`]'s flows, made for the root pipe's rule named `rule` alone
/// where one is named (none when it has no such rule).
fn specs(p: &Program, port: PortId, rule: Option<&str>, flows: u32) -> Vec<Spec> {
    let Some(root) = p.root_of(port) else {
        return Vec::new();
    };
    let pipe = p.pipe(root);
    if let (Some(_), PipeBody::Exact { .. } | PipeBody::Lpm { .. }) = (rule, &pipe.body) {
        return Vec::new();
    }
    let mut specs: Vec<Spec> = match &pipe.body {
        PipeBody::Rules(rules) => rules
            .iter()
            .filter(|r| rule.is_none_or(|name| r.name == name))
            .map(|r| {
                let mut s = Spec::default();
                // Tunnel fields first, so inner fields land in the right header.
                let mut ms: Vec<&FieldMatch> = r.matches.iter().collect();
                ms.sort_by_key(|m| !matches!(m.field.id, FieldId::VxlanVni | FieldId::GeneveVni));
                for m in ms {
                    s.apply(m);
                }
                s
            })
            .collect(),
        PipeBody::Lpm {
            field, prefixes, ..
        } => prefixes
            .iter()
            .map(|e| {
                let mut s = Spec::default();
                s.apply(&FieldMatch {
                    field: *field,
                    pattern: Pattern::prefix(e.value, e.len, field.kind()),
                });
                // A host inside the prefix rather than its network address.
                if u32::from(e.len) < u32::from(field.kind().bits()) {
                    s.dst |= 1;
                }
                s
            })
            .collect(),
        PipeBody::Exact { fields, keys, .. } => keys
            .chunks_exact(fields.len())
            .map(|key| {
                let mut s = Spec::default();
                for (f, v) in fields.iter().zip(key) {
                    s.apply(&FieldMatch {
                        field: *f,
                        pattern: Pattern::exact(*v, f.kind()),
                    });
                }
                s
            })
            .collect(),
    };
    if specs.is_empty() {
        if rule.is_some() {
            return Vec::new();
        }
        specs.push(Spec::default());
    }
    let flows = flows.max(1);
    (0..flows)
        .map(|i| specs[i as usize % specs.len()].flow(i / specs.len() as u32))
        .collect()
}

/// Where `dpuflow bench` takes its packets from, one at a time.
pub trait Source {
    /// Loads the next packet into `slot`, received on `port` at `ts_ns`.
    fn load_next(&mut self, slot: &mut PacketBuf, port: PortId, ts_ns: u64);

    /// The longest frame it loads.
    fn max_frame(&self) -> usize;

    /// Loads the next packets into `slots`, the first received at `ts_ns` and each `gap_ns`
    /// after the one before: one dynamic call a batch where a benchmark's source is chosen
    /// at run time.
    fn load_batch(&mut self, slots: &mut [PacketBuf], port: PortId, ts_ns: u64, gap_ns: u64) {
        let mut ts = ts_ns;
        for slot in slots {
            self.load_next(slot, port, ts);
            ts += gap_ns;
        }
    }
}

/// Frames taken in turn, over and over.
#[derive(Debug)]
pub struct Cycle<'a> {
    frames: &'a [Vec<u8>],
    next: usize,
}

impl<'a> Cycle<'a> {
    /// Cycles through `frames`, which must not be empty.
    pub fn new(frames: &'a [Vec<u8>]) -> Cycle<'a> {
        assert!(!frames.is_empty(), "no frames to cycle through");
        Cycle { frames, next: 0 }
    }
}

impl Source for Cycle<'_> {
    fn max_frame(&self) -> usize {
        self.frames.iter().map(Vec::len).max().unwrap_or(0)
    }

    #[inline]
    fn load_next(&mut self, slot: &mut PacketBuf, port: PortId, ts_ns: u64) {
        slot.load(&self.frames[self.next], port, ts_ns);
        self.next = if self.next + 1 == self.frames.len() {
            0
        } else {
            self.next + 1
        };
    }
}

/// TCP connections as a firewall sees bulk transfers, both directions arriving on one
/// port: each flow opens with a three-way handshake, then its client sends segments of the
/// frame size that its server acknowledges, each before the next. Packets go a round at a
/// time over the flows (every flow's SYN, then every SYN/ACK, every handshake ACK, then data
/// and acknowledgements in turn) and sequence numbers advance as a real connection's do,
/// so window tracking judges in-order segments. Without options (no window scaling).
#[derive(Debug)]
pub struct Conversations {
    flows: Vec<Conversation>,
    next: usize,
    round: u64,
}

/// One connection of [`Conversations`].
#[derive(Debug)]
struct Conversation {
    /// The client's data segment, then the client's and the server's headers alone.
    frames: [Vec<u8>; 3],
    /// Where the TCP header starts (the same in all three frames).
    l4: usize,
    /// The data segment's payload length.
    payload: u32,
    /// The frames' TCP checksums, with zero sequence numbers and flags.
    check: [u16; 3],
    /// The next sequence number of the client and of the server.
    seq: [u32; 2],
}

/// Rounds of [`Conversations`] before data flows: SYN, SYN/ACK, ACK.
pub const HANDSHAKE_ROUNDS: u64 = 3;

impl Conversations {
    /// The connections of `flows` flows through `port`'s root pipe (its rule named `rule`
    /// alone, where one is named), with data segments of `size` bytes; an error when an
    /// entry's packets are not plain TCP (tunnelled, or another protocol) or leave no room
    /// for data.
    pub fn new(
        p: &Program,
        port: PortId,
        rule: Option<&str>,
        size: usize,
        flows: u32,
    ) -> Result<Self, String> {
        let specs = specs(p, port, rule, flows);
        match (specs.is_empty(), rule) {
            (true, Some(rule)) => return Err(no_such_rule(p, port, rule)),
            (true, None) => return Err("the port feeds no root pipe".into()),
            _ => {}
        }
        let flows = specs
            .iter()
            .enumerate()
            .map(|(i, client)| {
                if client.proto != ip_proto::TCP || client.tunnel.is_some() {
                    return Err("conversations need root pipe entries that take plain TCP".into());
                }
                let server = Spec {
                    src_mac: client.dst_mac,
                    dst_mac: client.src_mac,
                    src: client.dst,
                    dst: client.src,
                    sport: client.dport,
                    dport: client.sport,
                    ..client.clone()
                };
                let mut frames = [client.frame(size), client.frame(0), server.frame(0)];
                let l4 = frames[1].len() - tcp::MIN_HEADER_LEN;
                let mut check = [0; 3];
                for (f, check) in frames.iter_mut().zip(&mut check) {
                    let t = &mut f[l4..];
                    let (flagged, bare) = (be16(t, 12), be16(t, 12) & 0xff00);
                    *check = checksum::update16(be16(t, 16), flagged, bare);
                    put16(t, 12, bare);
                    put16(t, 16, *check);
                }
                let payload = frames[0].len() - frames[1].len();
                if payload == 0 {
                    return Err(format!(
                        "{size}-byte frames leave no room for data after {} bytes of headers",
                        frames[1].len()
                    ));
                }
                // Initial sequence numbers spread over the space, so some wrap.
                let isn = (i as u32 + 1).wrapping_mul(0x9e37_79b9);
                Ok(Conversation {
                    frames,
                    l4,
                    payload: payload as u32,
                    check,
                    seq: [isn, isn ^ 0x8000_0000],
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Conversations {
            flows,
            next: 0,
            round: 0,
        })
    }

    /// How many connections it holds.
    pub fn connections(&self) -> usize {
        self.flows.len()
    }
}

impl Source for Conversations {
    fn max_frame(&self) -> usize {
        self.flows
            .iter()
            .map(|c| c.frames[0].len())
            .max()
            .unwrap_or(0)
    }

    #[inline]
    fn load_next(&mut self, slot: &mut PacketBuf, port: PortId, ts_ns: u64) {
        use crate::wire::tcp::flags::{ACK, PSH, SYN};
        const CLIENT: usize = 0;
        const SERVER: usize = 1;
        let c = &mut self.flows[self.next];
        // (frame, sender, flags, sequence space the segment takes)
        let (frame, from, flags, used) = match self.round {
            0 => (1, CLIENT, SYN, 1),
            1 => (2, SERVER, SYN | ACK, 1),
            2 => (1, CLIENT, ACK, 0),
            r if (r - HANDSHAKE_ROUNDS) % 2 == 0 => (0, CLIENT, PSH | ACK, c.payload),
            _ => (2, SERVER, ACK, 0),
        };
        slot.load(&c.frames[frame], port, ts_ns);
        let (seq, ack) = (c.seq[from], c.seq[from ^ 1]);
        // A SYN acknowledges nothing: its ACK field is zero.
        let ack = if flags & ACK != 0 { ack } else { 0 };
        let tcp = &mut slot.data_mut()[c.l4..];
        // The frames carry zero sequence numbers and no flags: the checksum takes the new
        // words in (RFC 1624 eqn. 3, each old word zero), folded once.
        let added = (seq >> 16) + (seq & 0xffff) + (ack >> 16) + (ack & 0xffff);
        let check = !checksum::fold(u32::from(!c.check[frame]) + added + u32::from(flags));
        put32(tcp, 4, seq);
        put32(tcp, 8, ack);
        tcp[13] = flags;
        put16(tcp, 16, check);
        c.seq[from] = seq.wrapping_add(used);
        self.next += 1;
        if self.next == self.flows.len() {
            self.next = 0;
            self.round += 1;
        }
    }
}
