//! IPFIX messages (RFC 7011) carrying flow records, sans I/O: the caller sends the bytes.
//!
//! Two templates, IPv4 and IPv6, with the information elements of RFC 7012 / IANA:
//! octetDeltaCount, packetDeltaCount, flowStartMilliseconds, flowEndMilliseconds,
//! ingressInterface, egressInterface, protocolIdentifier, source and destination address
//! and transport port, tcpControlBits, firewallEvent, flowEndReason, layer2SegmentId
//! (the VNI in its low 24 bits for tunnelled flows). Messages stay under a size limit so
//! they fit the path MTU; templates go out first and again every refresh interval
//! (RFC 7011 §8.4); the sequence number counts data records sent before each message
//! (§3.1).

use super::flows::FlowRecord;

const VERSION: u16 = 10;
const HEADER_LEN: usize = 16;
const SET_HEADER_LEN: usize = 4;
const TEMPLATE_SET: u16 = 2;
pub const TEMPLATE_V4: u16 = 256;
pub const TEMPLATE_V6: u16 = 257;

/// (information element id, length) of each template's fields, in record order.
fn fields(v6: bool) -> [(u16, u16); 15] {
    let (src, dst, alen) = if v6 { (27, 28, 16) } else { (8, 12, 4) };
    [
        (1, 8),   // octetDeltaCount
        (2, 8),   // packetDeltaCount
        (152, 8), // flowStartMilliseconds
        (153, 8), // flowEndMilliseconds
        (10, 4),  // ingressInterface
        (14, 4),  // egressInterface
        (4, 1),   // protocolIdentifier
        (src, alen),
        (dst, alen),
        (7, 2),   // sourceTransportPort
        (11, 2),  // destinationTransportPort
        (6, 2),   // tcpControlBits
        (233, 1), // firewallEvent
        (136, 1), // flowEndReason
        (351, 8), // layer2SegmentId
    ]
}

fn record_len(v6: bool) -> usize {
    fields(v6).iter().map(|&(_, l)| usize::from(l)).sum()
}

/// firewallEvent values (IANA): 2 flow deleted, 3 flow denied, 5 flow update.
fn firewall_event(r: &FlowRecord) -> u8 {
    match (r.denied, r.reason) {
        (true, _) => 3,
        (false, super::flows::EndReason::Active) => 5,
        (false, _) => 2,
    }
}

/// Builds messages for one observation domain.
#[derive(Debug)]
pub struct Exporter {
    domain: u32,
    max_message: usize,
    sequence: u32,
    template_refresh_s: u64,
    last_templates_s: Option<u64>,
}

impl Exporter {
    pub fn new(domain: u32, max_message: usize, template_refresh_s: u64) -> Exporter {
        Exporter {
            domain,
            max_message: max_message.max(256),
            sequence: 0,
            template_refresh_s,
            last_templates_s: None,
        }
    }

    /// Data records sent so far (the next message's sequence number).
    pub fn sequence(&self) -> u32 {
        self.sequence
    }

    fn header(&self, msg: &mut Vec<u8>, export_s: u32) {
        msg.extend_from_slice(&VERSION.to_be_bytes());
        msg.extend_from_slice(&[0, 0]);
        msg.extend_from_slice(&export_s.to_be_bytes());
        msg.extend_from_slice(&self.sequence.to_be_bytes());
        msg.extend_from_slice(&self.domain.to_be_bytes());
    }

    fn finish(msg: &mut [u8]) {
        let len = msg.len() as u16;
        msg[2..4].copy_from_slice(&len.to_be_bytes());
    }

    /// Messages for `records` at wall-clock second `now_s`, templates first when due.
    pub fn messages(&mut self, records: &[FlowRecord], now_s: u64) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        if self
            .last_templates_s
            .is_none_or(|t| now_s >= t + self.template_refresh_s)
        {
            let mut msg = Vec::with_capacity(self.max_message);
            self.header(&mut msg, now_s as u32);
            let set_at = msg.len();
            msg.extend_from_slice(&TEMPLATE_SET.to_be_bytes());
            msg.extend_from_slice(&[0, 0]);
            for (id, v6) in [(TEMPLATE_V4, false), (TEMPLATE_V6, true)] {
                let f = fields(v6);
                msg.extend_from_slice(&id.to_be_bytes());
                msg.extend_from_slice(&(f.len() as u16).to_be_bytes());
                for (ie, len) in f {
                    msg.extend_from_slice(&ie.to_be_bytes());
                    msg.extend_from_slice(&len.to_be_bytes());
                }
            }
            let set_len = (msg.len() - set_at) as u16;
            msg[set_at + 2..set_at + 4].copy_from_slice(&set_len.to_be_bytes());
            Self::finish(&mut msg);
            out.push(msg);
            self.last_templates_s = Some(now_s);
        }
        for v6 in [false, true] {
            let per = (self.max_message - HEADER_LEN - SET_HEADER_LEN) / record_len(v6);
            let mine: Vec<&FlowRecord> = records.iter().filter(|r| r.key.v6 == v6).collect();
            for chunk in mine.chunks(per) {
                let mut msg = Vec::with_capacity(self.max_message);
                self.header(&mut msg, now_s as u32);
                msg.extend_from_slice(&(if v6 { TEMPLATE_V6 } else { TEMPLATE_V4 }).to_be_bytes());
                msg.extend_from_slice(
                    &((SET_HEADER_LEN + chunk.len() * record_len(v6)) as u16).to_be_bytes(),
                );
                for r in chunk {
                    encode(&mut msg, r);
                }
                Self::finish(&mut msg);
                self.sequence = self.sequence.wrapping_add(chunk.len() as u32);
                out.push(msg);
            }
        }
        out
    }
}

fn encode(msg: &mut Vec<u8>, r: &FlowRecord) {
    let k = &r.key;
    msg.extend_from_slice(&r.bytes.to_be_bytes());
    msg.extend_from_slice(&r.packets.to_be_bytes());
    msg.extend_from_slice(&(r.first_ns / 1_000_000).to_be_bytes());
    msg.extend_from_slice(&(r.last_ns / 1_000_000).to_be_bytes());
    // Interface numbers start at 1: 0 means none.
    msg.extend_from_slice(&(u32::from(k.in_port) + 1).to_be_bytes());
    msg.extend_from_slice(&r.out_port.map_or(0, |p| u32::from(p) + 1).to_be_bytes());
    msg.push(k.proto);
    if k.v6 {
        msg.extend_from_slice(&k.src.to_be_bytes());
        msg.extend_from_slice(&k.dst.to_be_bytes());
    } else {
        msg.extend_from_slice(&(k.src as u32).to_be_bytes());
        msg.extend_from_slice(&(k.dst as u32).to_be_bytes());
    }
    msg.extend_from_slice(&k.sport.to_be_bytes());
    msg.extend_from_slice(&k.dport.to_be_bytes());
    msg.extend_from_slice(&u16::from(r.tcp_flags).to_be_bytes());
    msg.push(firewall_event(r));
    msg.push(r.reason as u8);
    // layer2SegmentId: segment type 0x01 (VXLAN) in the top byte, the VNI in the low 24 bits.
    let seg = k.vni.map_or(0u64, |v| 0x0100_0000_0000_0000 | u64::from(v));
    msg.extend_from_slice(&seg.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::flows::{EndReason, FlowKey};

    fn rec(n: u16, v6: bool) -> FlowRecord {
        FlowRecord {
            key: FlowKey {
                in_port: 0,
                v6,
                src: 1,
                dst: 2,
                proto: 17,
                sport: n,
                dport: 53,
                vni: Some(100),
            },
            first_ns: 1_000_000_000,
            last_ns: 2_000_000_000,
            packets: 3,
            bytes: 300,
            tcp_flags: 0,
            out_port: Some(1),
            denied: false,
            reason: EndReason::Idle,
        }
    }

    #[test]
    fn messages_fit_and_count_records() {
        let mut e = Exporter::new(1, 1400, 600);
        let records: Vec<FlowRecord> = (0..50).map(|n| rec(n, n % 5 == 0)).collect();
        let msgs = e.messages(&records, 1000);
        assert!(msgs
            .iter()
            .all(|m| m.len() <= 1400 && u16::from_be_bytes([m[2], m[3]]) as usize == m.len()));
        assert_eq!(u16::from_be_bytes([msgs[0][16], msgs[0][17]]), TEMPLATE_SET);
        assert_eq!(e.sequence(), 50);
        // Sequence numbers: each data message starts at the records sent before it.
        let mut seq = 0u32;
        for m in &msgs[1..] {
            assert_eq!(u32::from_be_bytes(m[8..12].try_into().unwrap()), seq);
            let set_len = u16::from_be_bytes([m[18], m[19]]) as usize;
            let v6 = u16::from_be_bytes([m[16], m[17]]) == TEMPLATE_V6;
            seq += ((set_len - 4) / record_len(v6)) as u32;
        }
        // No templates again before the refresh interval.
        assert!(e
            .messages(&records[..1], 1100)
            .iter()
            .all(|m| u16::from_be_bytes([m[16], m[17]]) != TEMPLATE_SET));
        // Templates again once the refresh interval has passed.
        let again = e.messages(&[], 1600);
        assert_eq!(
            u16::from_be_bytes([again[0][16], again[0][17]]),
            TEMPLATE_SET
        );
    }
}
