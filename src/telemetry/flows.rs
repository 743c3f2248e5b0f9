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
    /// Every field, in four fixed-size writes: the cache hashes each packet's key with a
    /// keyed hash, so crafted flows cannot aim at one bucket.
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        h.write_u128(u128::from_le_bytes(self.src));
        h.write_u128(u128::from_le_bytes(self.dst));
        h.write_u64(
            u64::from(self.sport) << 48
                | u64::from(self.dport) << 32
                | u64::from(self.proto) << 24
                | u64::from(self.v6) << 16
                | u64::from(self.in_port),
        );
        // VNIs are 24 bits: bit 31 tells VNI 0 from no tunnel.
        h.write_u32(self.vni.map_or(0, |v| v | 1 << 31));
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

/// A worker's flow cache, bounded. The index is open addressing with linear probing over
/// (hash, slot + 1) pairs, at most half full, with deletion by backward shift (no
/// tombstones): a lookup compares 32-bit hashes and reads a flow's key only on a match.
#[derive(Debug)]
pub struct FlowCache {
    buckets: Vec<(u32, u32)>,
    mask: usize,
    hasher: ahash::RandomState,
    len: usize,
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
        let buckets = (capacity.max(1) * 2).next_power_of_two();
        FlowCache {
            buckets: vec![(0, 0); buckets],
            mask: buckets - 1,
            hasher: ahash::RandomState::new(),
            len: 0,
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
        let hash = self.hasher.hash_one(key) as u32;
        let empty = match self.find(&key, hash) {
            Ok(b) => {
                let h = &mut self.hot[self.buckets[b].1 as usize - 1];
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
            Err(empty) => empty,
        };
        if self.len >= self.capacity {
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
        self.buckets[empty] = (hash, i + 1);
        self.len += 1;
    }

    /// The bucket holding `key` (`Ok`), or the empty bucket ending its probe (`Err`).
    #[inline]
    fn find(&self, key: &FlowKey, hash: u32) -> Result<usize, usize> {
        let mut b = hash as usize & self.mask;
        loop {
            let (h, slot) = self.buckets[b];
            if slot == 0 {
                return Err(b);
            }
            if h == hash && self.cold[slot as usize - 1].is_some_and(|c| c.key == *key) {
                return Ok(b);
            }
            b = (b + 1) & self.mask;
        }
    }

    /// Empties bucket `hole`, moving later entries of the probe run back so every
    /// probe still reaches its entry before an empty bucket.
    fn remove_bucket(&mut self, mut hole: usize) {
        let mut b = (hole + 1) & self.mask;
        loop {
            let (h, slot) = self.buckets[b];
            if slot == 0 {
                break;
            }
            let home = h as usize & self.mask;
            // Movable when its home is not cyclically within (hole, b].
            if (b.wrapping_sub(home) & self.mask) >= (b.wrapping_sub(hole) & self.mask) {
                self.buckets[hole] = (h, slot);
                hole = b;
            }
            b = (b + 1) & self.mask;
        }
        self.buckets[hole] = (0, 0);
        self.len -= 1;
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
                let hash = self.hasher.hash_one(c.key) as u32;
                if let Ok(b) = self.find(&c.key, hash) {
                    self.remove_bucket(b);
                }
                self.cold[i] = None;
                self.free.push(i as u32);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn key(n: u16) -> FlowKey {
        FlowKey {
            in_port: n % 3,
            src: u128::from(n % 17).to_be_bytes(),
            dst: u128::from(n / 17).to_be_bytes(),
            proto: 17,
            sport: n,
            dport: 53,
            ..FlowKey::default()
        }
    }

    proptest! {
        /// Counts, idle expiry and the capacity bound agree with a plain map, through
        /// removals that shift probe runs (a small table keeps runs long).
        #[test]
        fn cache_counts_like_a_map(ops in proptest::collection::vec((0u16..40, 0u8..10), 1..400)) {
            const IDLE: u64 = 50;
            let mut c = FlowCache::new(24, u64::MAX, IDLE);
            let mut model: HashMap<FlowKey, (u64, u64)> = HashMap::new();
            let mut out = Vec::new();
            for (now, (n, op)) in ops.into_iter().enumerate() {
                let now = now as u64 * 3;
                if op == 0 {
                    out.clear();
                    c.expire(now, false, &mut out);
                    let idle: Vec<FlowKey> = model
                        .iter()
                        .filter(|(_, (_, last))| now - last >= IDLE)
                        .map(|(k, _)| *k)
                        .collect();
                    let mut got: Vec<(u16, u64)> = out.iter().map(|r| (r.key.sport, r.packets)).collect();
                    let mut want: Vec<(u16, u64)> = idle.iter().map(|k| (k.sport, model[k].0)).collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    prop_assert_eq!(got, want);
                    for k in idle {
                        model.remove(&k);
                    }
                } else {
                    let k = key(n);
                    c.update(k, now, 100, 0, Some(1), false);
                    if let Some(e) = model.get_mut(&k) {
                        *e = (e.0 + 1, now);
                    } else if model.len() < 24 {
                        model.insert(k, (1, now));
                    }
                }
                prop_assert_eq!(c.len(), model.len());
            }
            out.clear();
            c.expire(u64::MAX, true, &mut out);
            let mut got: Vec<(u16, u64)> = out.iter().map(|r| (r.key.sport, r.packets)).collect();
            let mut want: Vec<(u16, u64)> = model.iter().map(|(k, (p, _))| (k.sport, *p)).collect();
            got.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }
}
