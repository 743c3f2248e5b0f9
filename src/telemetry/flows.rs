//! The flow cache behind IPFIX export, like VPP's flowprobe: every flow the pipeline sees,
//! keyed by ingress port, addresses, protocol, transport ports and VNI, with packet and
//! byte counts since its last export. Time is the packets' own.

use crate::engine::parse::{Meta, L3};
use crate::wire::{be16, ip_proto};

/// What identifies a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FlowKey {
    pub in_port: u16,
    pub v6: bool,
    /// IPv4 addresses in the last four bytes.
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    /// The VNI of the tunnel the packet arrived in, if any.
    pub vni: Option<u32>,
}

impl std::hash::Hash for FlowKey {
    /// One mixed word instead of a write per field: the cache hashes every packet.
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let w = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let mut x = w(&self.src[..8])
            ^ w(&self.src[8..]).rotate_left(13)
            ^ w(&self.dst[..8]).rotate_left(29)
            ^ w(&self.dst[8..]).rotate_left(41);
        x ^= u64::from(self.sport) << 48
            | u64::from(self.dport) << 32
            | u64::from(self.proto) << 24
            | u64::from(self.in_port);
        x ^= u64::from(self.vni.unwrap_or(0)).rotate_left(7);
        h.write_u64(x.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    }
}

impl FlowKey {
    /// The key of a parsed packet, from its outer headers; `None` for non-IP packets.
    pub fn of(frame: &[u8], meta: &Meta, in_port: u16) -> Option<FlowKey> {
        let l = &meta.outer;
        let l3 = usize::from(l.l3);
        let mut k = FlowKey {
            in_port,
            proto: l.proto,
            vni: meta.tunnel.map(|t| t.vni),
            ..FlowKey::default()
        };
        match l.l3_kind {
            L3::V4 => {
                k.src[12..].copy_from_slice(&frame[l3 + 12..l3 + 16]);
                k.dst[12..].copy_from_slice(&frame[l3 + 16..l3 + 20]);
            }
            L3::V6 => {
                k.v6 = true;
                k.src.copy_from_slice(&frame[l3 + 8..l3 + 24]);
                k.dst.copy_from_slice(&frame[l3 + 24..l3 + 40]);
            }
            L3::None => return None,
        }
        if l.l4_ok && matches!(l.proto, ip_proto::TCP | ip_proto::UDP | ip_proto::SCTP) {
            let l4 = usize::from(l.l4);
            k.sport = be16(frame, l4);
            k.dport = be16(frame, l4 + 2);
        }
        Some(k)
    }
}

/// Why a record was exported (IPFIX flowEndReason, RFC 5102).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EndReason {
    Idle = 1,
    Active = 2,
    Forced = 4,
}

/// One exported record: a flow's counts since its previous export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowRecord {
    pub key: FlowKey,
    pub first_ns: u64,
    pub last_ns: u64,
    pub packets: u64,
    /// IP bytes (header and payload), as IPFIX counts octets.
    pub bytes: u64,
    pub tcp_flags: u8,
    /// Port the flow's packets went out of, if any.
    pub out_port: Option<u16>,
    /// The pipeline dropped the flow's packets.
    pub denied: bool,
    pub reason: EndReason,
}

/// What every packet of a flow updates: kept apart from the rest (32 bytes), so the cache's
/// per-packet work touches little memory.
#[derive(Debug, Clone, Copy, Default)]
struct Hot {
    packets: u64,
    bytes: u64,
    last_ns: u64,
    /// Port index the packets went out of, `u16::MAX` for none.
    out_port: u16,
    tcp_flags: u8,
    denied: bool,
}

/// The rest of a flow, read at export.
#[derive(Debug, Clone, Copy)]
struct Cold {
    key: FlowKey,
    first_ns: u64,
    /// When the current reporting interval began (for the active timeout).
    since_ns: u64,
}

const NO_PORT: u16 = u16::MAX;

/// A worker's flow cache, bounded.
#[derive(Debug)]
pub struct FlowCache {
    index: std::collections::HashMap<FlowKey, u32, ahash::RandomState>,
    hot: Vec<Hot>,
    cold: Vec<Option<Cold>>,
    free: Vec<u32>,
    capacity: usize,
    active_ns: u64,
    idle_ns: u64,
    /// Flows not tracked because the cache was full.
    pub overflow: u64,
}

impl FlowCache {
    pub fn new(capacity: usize, active_ns: u64, idle_ns: u64) -> FlowCache {
        let mut index = std::collections::HashMap::with_hasher(ahash::RandomState::new());
        index.reserve(capacity.min(1 << 16));
        FlowCache {
            index,
            hot: Vec::new(),
            cold: Vec::new(),
            free: Vec::new(),
            capacity,
            active_ns,
            idle_ns,
            overflow: 0,
        }
    }

    /// Counts one packet of `key`.
    #[inline]
    pub fn update(
        &mut self,
        key: FlowKey,
        now: u64,
        ip_bytes: u64,
        tcp_flags: u8,
        out_port: Option<u16>,
        denied: bool,
    ) {
        let out = out_port.unwrap_or(NO_PORT);
        if let Some(&i) = self.index.get(&key) {
            let h = &mut self.hot[i as usize];
            h.packets += 1;
            h.bytes += ip_bytes;
            h.last_ns = h.last_ns.max(now);
            h.tcp_flags |= tcp_flags;
            if out != NO_PORT {
                h.out_port = out;
            }
            h.denied |= denied;
            return;
        }
        if self.index.len() >= self.capacity {
            self.overflow += 1;
            return;
        }
        let hot = Hot {
            packets: 1,
            bytes: ip_bytes,
            last_ns: now,
            out_port: out,
            tcp_flags,
            denied,
        };
        let cold = Some(Cold {
            key,
            first_ns: now,
            since_ns: now,
        });
        let i = match self.free.pop() {
            Some(i) => {
                self.hot[i as usize] = hot;
                self.cold[i as usize] = cold;
                i
            }
            None => {
                self.hot.push(hot);
                self.cold.push(cold);
                (self.hot.len() - 1) as u32
            }
        };
        self.index.insert(key, i);
    }

    /// Moves the records due at `now` to `out`: idle flows (removed) and flows past the
    /// active timeout (their counts restart). With `all`, every flow (forced end).
    pub fn expire(&mut self, now: u64, all: bool, out: &mut Vec<FlowRecord>) {
        for i in 0..self.hot.len() {
            let Some(c) = self.cold[i] else { continue };
            let h = self.hot[i];
            let reason = if all {
                EndReason::Forced
            } else if now.saturating_sub(h.last_ns) >= self.idle_ns {
                EndReason::Idle
            } else if now.saturating_sub(c.since_ns) >= self.active_ns && h.packets > 0 {
                EndReason::Active
            } else {
                continue;
            };
            out.push(FlowRecord {
                key: c.key,
                first_ns: c.first_ns,
                last_ns: h.last_ns,
                packets: h.packets,
                bytes: h.bytes,
                tcp_flags: h.tcp_flags,
                out_port: (h.out_port != NO_PORT).then_some(h.out_port),
                denied: h.denied,
                reason,
            });
            if reason == EndReason::Active {
                self.hot[i] = Hot {
                    last_ns: h.last_ns,
                    out_port: h.out_port,
                    ..Hot::default()
                };
                self.cold[i] = Some(Cold {
                    first_ns: h.last_ns,
                    since_ns: now,
                    ..c
                });
            } else {
                self.index.remove(&c.key);
                self.cold[i] = None;
                self.free.push(i as u32);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }
}
