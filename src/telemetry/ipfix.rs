//! IPFIX messages (RFC 7011) carrying flow records, sans I/O: the caller sends the bytes.
//!
//! Two templates, IPv4 and IPv6, with the information elements of RFC 7012 / IANA:
//! octetDeltaCount, packetDeltaCount, flowStartMilliseconds, flowEndMilliseconds,
//! ingressInterface, egressInterface, protocolIdentifier, source and destination address
//! and transport port, icmpTypeCodeIPv4 or icmpTypeCodeIPv6 (zero but for ICMP, whose
//! ports are zero), tcpControlBits, firewallEvent, flowEndReason, layer2SegmentId
//! (the VNI in its low 24 bits for tunnelled flows). Messages stay under a size limit so
//! they fit the path MTU (at least 512 bytes, which the templates' message needs); templates go out first and again every refresh interval
//! (RFC 7011 §8.4); the sequence number counts data records sent before each message
//! (§3.1).
//!
//! When the flow cache samples packets, its records go out with two more templates that
//! add selectorId, and the templates' message also carries the selector's report
//! interpretation (RFC 5476 §6.5.2): an options record naming the algorithm (random
//! n-out-of-N, RFC 5477 §8.2.3) with its sample size (1) and population (N), from which a
//! collector scales the counts up. Records from connections count every packet and keep
//! the plain templates.
//!
//! With the templates also go the interfaces' names: an options template scoped by
//! ingressInterface with interfaceName, and a record per port, so a collector can show
//! `host` where a record says interface 1. When the flow cache had no room for some flows,
//! a record of the metering process's reliability statistics (RFC 7011 §4.2: scope
//! observationDomainId, ignoredPacketTotalCount, ignoredOctetTotalCount) tells the
//! collector what the records miss.

use super::flows::{EndReason, FlowKey, FlowRecord};
use crate::wire::ip_proto;

const VERSION: u16 = 10;
const HEADER_LEN: usize = 16;
const SET_HEADER_LEN: usize = 4;
const TEMPLATE_SET: u16 = 2;
const OPTIONS_TEMPLATE_SET: u16 = 3;
pub const TEMPLATE_V4: u16 = 256;
pub const TEMPLATE_V6: u16 = 257;
pub const TEMPLATE_V4_SAMPLED: u16 = 258;
pub const TEMPLATE_V6_SAMPLED: u16 = 259;
/// The options template of the selector report (RFC 5476 §6.5.2).
pub const TEMPLATE_SELECTOR: u16 = 260;
/// The options template naming interfaces: ingressInterface (scope) → interfaceName.
pub const TEMPLATE_INTERFACES: u16 = 261;
/// The options template of the metering process's reliability statistics (RFC 7011
/// §4.2): what the flow records miss.
pub const TEMPLATE_IGNORED: u16 = 262;
/// A field length saying each value carries its own (RFC 7011 §7).
const VARIABLE_LENGTH: u16 = 65535;
/// (information element id, length) of an interface's name record.
const INTERFACE_FIELDS: [(u16, u16); 2] = [(10, 4), (82, VARIABLE_LENGTH)];
/// (information element id, length) of the reliability statistics: the scope,
/// observationDomainId, then ignoredPacketTotalCount and ignoredOctetTotalCount.
const IGNORED_FIELDS: [(u16, u16); 3] = [(149, 4), (164, 8), (165, 8)];
/// The smallest size limit taken: the templates' message (under 400 bytes with the
/// sampled templates, the options templates and the selector report) must fit in one.
const MIN_MESSAGE: usize = 512;
/// The flow cache's one selector.
const SELECTOR_ID: u64 = 1;
/// selectorAlgorithm 3: random n-out-of-N sampling (IANA PSAMP parameters).
const RANDOM_N_OUT_OF_N: u16 = 3;

/// (information element id, length) of the selector report's fields: the scope,
/// selectorId, then selectorAlgorithm, samplingSize and samplingPopulation.
const SELECTOR_FIELDS: [(u16, u16); 4] = [(302, 8), (304, 2), (309, 4), (310, 4)];

/// A data template: the address family and whether records carry a selectorId.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Template {
    v6: bool,
    sampled: bool,
}

impl Template {
    const ALL: [Template; 4] = [
        Template::of(false, false),
        Template::of(true, false),
        Template::of(false, true),
        Template::of(true, true),
    ];

    const fn of(v6: bool, sampled: bool) -> Template {
        Template { v6, sampled }
    }

    fn id(self) -> u16 {
        match (self.v6, self.sampled) {
            (false, false) => TEMPLATE_V4,
            (true, false) => TEMPLATE_V6,
            (false, true) => TEMPLATE_V4_SAMPLED,
            (true, true) => TEMPLATE_V6_SAMPLED,
        }
    }

    /// (information element id, length) of each field, in record order.
    fn fields(self) -> impl Iterator<Item = (u16, u16)> {
        let (src, dst, alen) = if self.v6 { (27, 28, 16) } else { (8, 12, 4) };
        // icmpTypeCodeIPv6 or icmpTypeCodeIPv4.
        let icmp = if self.v6 { 139 } else { 32 };
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
            (7, 2),  // sourceTransportPort
            (11, 2), // destinationTransportPort
            (icmp, 2),
            (6, 2),   // tcpControlBits
            (233, 1), // firewallEvent
            (136, 1), // flowEndReason
            (351, 8), // layer2SegmentId
        ]
        .into_iter()
        .chain(self.sampled.then_some((302, 8))) // selectorId
    }

    fn record_len(self) -> usize {
        self.fields().map(|(_, l)| usize::from(l)).sum()
    }
}

/// firewallEvent values (IANA): 2 flow deleted, 3 flow denied, 5 flow update.
fn firewall_event(r: &FlowRecord) -> u8 {
    match (r.denied, r.reason) {
        (true, _) => 3,
        (false, EndReason::Active) => 5,
        (false, _) => 2,
    }
}

fn put16(msg: &mut Vec<u8>, v: u16) {
    msg.extend_from_slice(&v.to_be_bytes());
}

/// Starts a set of `id`; [`end_set`] writes its length.
fn start_set(msg: &mut Vec<u8>, id: u16) -> usize {
    put16(msg, id);
    put16(msg, 0);
    msg.len() - SET_HEADER_LEN
}

fn end_set(msg: &mut [u8], at: usize) {
    let len = (msg.len() - at) as u16;
    msg[at + 2..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Builds messages for one observation domain.
#[derive(Debug)]
pub struct Exporter {
    domain: u32,
    max_message: usize,
    sequence: u32,
    template_refresh_s: u64,
    last_templates_s: Option<u64>,
    /// The flow cache's sampling interval (1: every packet, no selector to report).
    sampling: u32,
    /// Interface names by index (ingressInterface and egressInterface are index + 1),
    /// sent with the templates.
    interfaces: Vec<String>,
}

impl Exporter {
    /// `sampling` is the flow cache's packet interval ([`crate::ir::Telemetry::sampling`]).
    pub fn new(
        domain: u32,
        max_message: usize,
        template_refresh_s: u64,
        sampling: u32,
    ) -> Exporter {
        Exporter {
            domain,
            max_message: max_message.max(MIN_MESSAGE),
            sequence: 0,
            template_refresh_s,
            last_templates_s: None,
            sampling: sampling.max(1),
            interfaces: Vec::new(),
        }
    }

    /// Names the interfaces (ports, by index) in the export, so a collector can show
    /// `host` where a record says ingressInterface 1. Names are cut to 254 bytes.
    pub fn naming(mut self, interfaces: Vec<String>) -> Exporter {
        self.interfaces = interfaces;
        self
    }

    /// Data records sent so far (the next message's sequence number).
    pub fn sequence(&self) -> u32 {
        self.sequence
    }

    fn header(&self, msg: &mut Vec<u8>, export_s: u32) {
        put16(msg, VERSION);
        put16(msg, 0);
        msg.extend_from_slice(&export_s.to_be_bytes());
        msg.extend_from_slice(&self.sequence.to_be_bytes());
        msg.extend_from_slice(&self.domain.to_be_bytes());
    }

    fn finish(msg: &mut [u8]) {
        let len = msg.len() as u16;
        msg[2..4].copy_from_slice(&len.to_be_bytes());
    }

    /// The templates: the data templates, the options templates in use (the selector
    /// report's, the interface names', the reliability statistics'), and with sampling the
    /// selector report's one record (counted in the sequence like any data record).
    fn templates(&mut self, now_s: u64) -> Vec<u8> {
        let sampled = self.sampling > 1;
        let mut msg = Vec::with_capacity(self.max_message);
        self.header(&mut msg, now_s as u32);
        let set = start_set(&mut msg, TEMPLATE_SET);
        for t in Template::ALL.into_iter().filter(|t| sampled || !t.sampled) {
            put16(&mut msg, t.id());
            put16(&mut msg, t.fields().count() as u16);
            for (ie, len) in t.fields() {
                put16(&mut msg, ie);
                put16(&mut msg, len);
            }
        }
        end_set(&mut msg, set);
        let named = !self.interfaces.is_empty();
        // RFC 7011 §3.4.2.2: template id, field count, scope field count, fields.
        let set = start_set(&mut msg, OPTIONS_TEMPLATE_SET);
        let options = [
            (sampled, TEMPLATE_SELECTOR, &SELECTOR_FIELDS[..]),
            (named, TEMPLATE_INTERFACES, &INTERFACE_FIELDS[..]),
            (true, TEMPLATE_IGNORED, &IGNORED_FIELDS[..]),
        ];
        for (_, id, fields) in options.into_iter().filter(|o| o.0) {
            put16(&mut msg, id);
            put16(&mut msg, fields.len() as u16);
            put16(&mut msg, 1);
            for &(ie, len) in fields {
                put16(&mut msg, ie);
                put16(&mut msg, len);
            }
        }
        end_set(&mut msg, set);
        if sampled {
            // One packet out of each `sampling` (RFC 5477 §8.2.3).
            let set = start_set(&mut msg, TEMPLATE_SELECTOR);
            msg.extend_from_slice(&SELECTOR_ID.to_be_bytes());
            put16(&mut msg, RANDOM_N_OUT_OF_N);
            msg.extend_from_slice(&1u32.to_be_bytes());
            msg.extend_from_slice(&self.sampling.to_be_bytes());
            end_set(&mut msg, set);
            self.sequence = self.sequence.wrapping_add(1);
        }
        Self::finish(&mut msg);
        msg
    }

    /// The interfaces' names, as many to a message as fit.
    fn interface_names(&mut self, now_s: u64, emit: &mut dyn FnMut(&[u8])) {
        let mut at = 0;
        while at < self.interfaces.len() {
            let mut msg = Vec::with_capacity(self.max_message);
            self.header(&mut msg, now_s as u32);
            let set = start_set(&mut msg, TEMPLATE_INTERFACES);
            let mut n = 0u32;
            for (i, name) in self.interfaces.iter().enumerate().skip(at) {
                let name = &name.as_bytes()[..name.len().min(254)];
                // Index, then the name with its one-byte length (under 255, RFC 7011 §7).
                if msg.len() + 5 + name.len() > self.max_message {
                    break;
                }
                msg.extend_from_slice(&(i as u32 + 1).to_be_bytes());
                msg.push(name.len() as u8);
                msg.extend_from_slice(name);
                n += 1;
            }
            end_set(&mut msg, set);
            Self::finish(&mut msg);
            self.sequence = self.sequence.wrapping_add(n);
            at += n as usize;
            emit(&msg);
        }
    }

    /// Sends the templates again with the next messages (to a collector that has not seen
    /// them: one that moved).
    pub fn resend_templates(&mut self) {
        self.last_templates_s = None;
    }

    /// The templates (and the interfaces' names), when due.
    fn templates_if_due(&mut self, now_s: u64, emit: &mut dyn FnMut(&[u8])) {
        if self
            .last_templates_s
            .is_none_or(|t| now_s >= t + self.template_refresh_s)
        {
            emit(&self.templates(now_s));
            self.interface_names(now_s, emit);
            self.last_templates_s = Some(now_s);
        }
    }

    /// The metering process's reliability statistics at wall-clock second `now_s`: the
    /// packets, and their IP bytes, that no flow record counts (the flow cache had no room
    /// for their flows), since the start. One options record, templates first when due;
    /// each message handed to `emit`.
    pub fn ignored(&mut self, packets: u64, octets: u64, now_s: u64, emit: &mut dyn FnMut(&[u8])) {
        self.templates_if_due(now_s, emit);
        let mut msg = Vec::with_capacity(HEADER_LEN + SET_HEADER_LEN + 20);
        self.header(&mut msg, now_s as u32);
        let set = start_set(&mut msg, TEMPLATE_IGNORED);
        msg.extend_from_slice(&self.domain.to_be_bytes());
        msg.extend_from_slice(&packets.to_be_bytes());
        msg.extend_from_slice(&octets.to_be_bytes());
        end_set(&mut msg, set);
        Self::finish(&mut msg);
        self.sequence = self.sequence.wrapping_add(1);
        emit(&msg);
    }

    /// The messages for `records` at wall-clock second `now_s`, templates (and the
    /// interfaces' names) first when due, each handed to `emit` as soon as it is made: a
    /// million records are not held twice over, and the first go out at once.
    pub fn messages(&mut self, records: &[FlowRecord], now_s: u64, emit: &mut dyn FnMut(&[u8])) {
        self.templates_if_due(now_s, emit);
        let mut msg = Vec::with_capacity(self.max_message);
        for t in Template::ALL {
            let per = (self.max_message - HEADER_LEN - SET_HEADER_LEN) / t.record_len();
            let mut mine = records
                .iter()
                .filter(|r| Template::of(r.key.v6, r.sampled) == t)
                .peekable();
            while mine.peek().is_some() {
                msg.clear();
                self.header(&mut msg, now_s as u32);
                let set = start_set(&mut msg, t.id());
                let n = mine.by_ref().take(per).map(|r| encode(&mut msg, r)).count();
                end_set(&mut msg, set);
                Self::finish(&mut msg);
                self.sequence = self.sequence.wrapping_add(n as u32);
                emit(&msg);
            }
        }
    }
}

/// A flow's (destinationTransportPort, icmpTypeCode): [`FlowKey::dport`] is the one or
/// the other by protocol.
fn icmp_split(k: &FlowKey) -> (u16, u16) {
    if ip_proto::is_icmp(k.proto) {
        (0, k.dport)
    } else {
        (k.dport, 0)
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
    // An ICMP flow's type and code stand where its destination port would.
    let (dport, icmp) = icmp_split(k);
    msg.extend_from_slice(&k.sport.to_be_bytes());
    msg.extend_from_slice(&dport.to_be_bytes());
    msg.extend_from_slice(&icmp.to_be_bytes());
    msg.extend_from_slice(&u16::from(r.tcp_flags).to_be_bytes());
    msg.push(firewall_event(r));
    msg.push(r.reason as u8);
    // layer2SegmentId: segment type 0x01 (VXLAN) in the top byte, the VNI in the low 24 bits.
    let seg = k.vni.map_or(0u64, |v| 0x0100_0000_0000_0000 | u64::from(v));
    msg.extend_from_slice(&seg.to_be_bytes());
    if r.sampled {
        msg.extend_from_slice(&SELECTOR_ID.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::flows::FlowKey;
    use proptest::prelude::*;

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
            sampled: false,
        }
    }

    impl Exporter {
        /// The messages of [`Exporter::messages`], collected.
        fn all_messages(&mut self, records: &[FlowRecord], now_s: u64) -> Vec<Vec<u8>> {
            let mut out = Vec::new();
            self.messages(records, now_s, &mut |m| out.push(m.to_vec()));
            out
        }

        /// The messages of [`Exporter::ignored`], collected.
        fn all_ignored(&mut self, packets: u64, octets: u64, now_s: u64) -> Vec<Vec<u8>> {
            let mut out = Vec::new();
            self.ignored(packets, octets, now_s, &mut |m| out.push(m.to_vec()));
            out
        }
    }

    fn u16_at(m: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([m[at], m[at + 1]])
    }

    fn u32_at(m: &[u8], at: usize) -> u32 {
        u32::from_be_bytes(m[at..at + 4].try_into().unwrap())
    }

    #[test]
    fn messages_fit_and_count_records() {
        let mut e = Exporter::new(1, 1400, 600, 1);
        let records: Vec<FlowRecord> = (0..50).map(|n| rec(n, n % 5 == 0)).collect();
        let msgs = e.all_messages(&records, 1000);
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
            seq += ((set_len - 4) / Template::of(v6, false).record_len()) as u32;
        }
        // No templates again before the refresh interval.
        assert!(e
            .all_messages(&records[..1], 1100)
            .iter()
            .all(|m| u16::from_be_bytes([m[16], m[17]]) != TEMPLATE_SET));
        // Templates again once the refresh interval has passed.
        let again = e.all_messages(&[], 1600);
        assert_eq!(
            u16::from_be_bytes([again[0][16], again[0][17]]),
            TEMPLATE_SET
        );
        // And at once when asked (the collector moved), the sequence going on.
        assert!(e
            .all_messages(&records[..1], 1601)
            .iter()
            .all(|m| m[16..18] != TEMPLATE_SET.to_be_bytes()));
        let sequence = e.sequence();
        e.resend_templates();
        let moved = e.all_messages(&records[..1], 1602);
        assert_eq!(moved[0][16..18], TEMPLATE_SET.to_be_bytes());
        assert_eq!(u32_at(&moved[0], 8), sequence);
    }

    /// With sampling, the templates' message holds the four data templates, the selector
    /// report's options template and its record (one packet out of N), which the sequence
    /// counts; sampled records go out with the selector's templates.
    #[test]
    fn sampled_records_name_their_selector() {
        let mut e = Exporter::new(7, 1400, 600, 100);
        let records = [
            rec(1, false),
            FlowRecord {
                sampled: true,
                ..rec(2, false)
            },
            FlowRecord {
                sampled: true,
                ..rec(3, true)
            },
        ];
        let msgs = e.all_messages(&records, 1000);
        let t = &msgs[0];
        assert_eq!(u32_at(t, 8), 0, "no data record before the first message");
        let mut at = HEADER_LEN;
        let mut sets = Vec::new();
        while at < t.len() {
            sets.push((u16_at(t, at), at));
            at += usize::from(u16_at(t, at + 2));
        }
        assert_eq!(at, t.len(), "sets fill the message");
        let ids: Vec<u16> = sets.iter().map(|s| s.0).collect();
        assert_eq!(ids, [TEMPLATE_SET, OPTIONS_TEMPLATE_SET, TEMPLATE_SELECTOR]);
        let data = sets[2].1 + SET_HEADER_LEN;
        assert_eq!(u64::from_be_bytes(t[data..data + 8].try_into().unwrap()), 1);
        assert_eq!(u16_at(t, data + 8), RANDOM_N_OUT_OF_N);
        assert_eq!((u32_at(t, data + 10), u32_at(t, data + 14)), (1, 100));
        // Then one message per template, each counting the records before it.
        let data_ids: Vec<(u16, u32)> = msgs[1..]
            .iter()
            .map(|m| (u16_at(m, HEADER_LEN), u32_at(m, 8)))
            .collect();
        assert_eq!(
            data_ids,
            [
                (TEMPLATE_V4, 1),
                (TEMPLATE_V4_SAMPLED, 2),
                (TEMPLATE_V6_SAMPLED, 3)
            ]
        );
        let sampled = &msgs[2];
        let end = sampled.len();
        assert_eq!(
            end,
            HEADER_LEN + SET_HEADER_LEN + Template::of(false, true).record_len()
        );
        assert_eq!(
            u64::from_be_bytes(sampled[end - 8..].try_into().unwrap()),
            SELECTOR_ID
        );
        assert_eq!(e.sequence(), 4);
    }

    /// Without sampling no selector is reported: two data templates, the reliability
    /// statistics' options template alone, nothing counted.
    #[test]
    fn unsampled_exports_report_no_selector() {
        let mut e = Exporter::new(7, 1400, 600, 1);
        let t = &e.all_messages(&[], 1000)[0];
        assert_eq!(u16_at(t, HEADER_LEN), TEMPLATE_SET);
        let options = HEADER_LEN + usize::from(u16_at(t, HEADER_LEN + 2));
        assert_eq!(u16_at(t, options), OPTIONS_TEMPLATE_SET);
        assert_eq!(u16_at(t, options + SET_HEADER_LEN), TEMPLATE_IGNORED);
        assert_eq!(
            options + usize::from(u16_at(t, options + 2)),
            t.len(),
            "two sets"
        );
        assert_eq!(e.sequence(), 0);
    }

    /// The reliability statistics: one options record of the domain, the packets and
    /// bytes no record counts, counted in the sequence; templates first when due.
    #[test]
    fn ignored_packets_are_reported_in_one_record() {
        let mut e = Exporter::new(7, 1400, 600, 1);
        let first = e.all_ignored(5, 300, 1000);
        assert_eq!(first.len(), 2, "templates, then the record");
        let m = &first[1];
        assert_eq!(u32_at(m, 8), 0);
        assert_eq!(u16_at(m, HEADER_LEN), TEMPLATE_IGNORED);
        let data = HEADER_LEN + SET_HEADER_LEN;
        assert_eq!(m.len(), data + 20);
        assert_eq!(u32_at(m, data), 7);
        assert_eq!(
            u64::from_be_bytes(m[data + 4..data + 12].try_into().unwrap()),
            5
        );
        assert_eq!(u64::from_be_bytes(m[data + 12..].try_into().unwrap()), 300);
        assert_eq!(e.sequence(), 1);
        assert_eq!(
            e.all_ignored(6, 400, 1001).len(),
            1,
            "templates not due again"
        );
        assert_eq!(e.sequence(), 2);
    }

    /// A decoder driven by the templates the messages carry: set by set, each data record
    /// read field by field into (information element, value).
    struct Decoder {
        templates: std::collections::HashMap<u16, Vec<(u16, u16)>>,
        records: Vec<Vec<(u16, u128)>>,
        /// Interface names as the options records give them: (ingressInterface, name).
        names: Vec<(u128, String)>,
        /// Data records seen (the options records too), the next sequence number.
        counted: u32,
    }

    impl Decoder {
        fn message(&mut self, m: &[u8], max: usize) {
            assert!(m.len() <= max, "{} bytes over {max}", m.len());
            assert_eq!(usize::from(u16_at(m, 2)), m.len());
            assert_eq!(u32_at(m, 8), self.counted, "sequence number");
            let mut at = HEADER_LEN;
            while at < m.len() {
                let (id, len) = (u16_at(m, at), usize::from(u16_at(m, at + 2)));
                let body = &m[at + SET_HEADER_LEN..at + len];
                match id {
                    TEMPLATE_SET | OPTIONS_TEMPLATE_SET => {
                        let mut b = 0;
                        while b < body.len() {
                            let (tid, count) = (u16_at(body, b), usize::from(u16_at(body, b + 2)));
                            b += if id == OPTIONS_TEMPLATE_SET { 6 } else { 4 };
                            let fields = (0..count)
                                .map(|f| (u16_at(body, b + 4 * f), u16_at(body, b + 4 * f + 2)))
                                .collect();
                            b += 4 * count;
                            self.templates.insert(tid, fields);
                        }
                    }
                    _ => {
                        let fields = self.templates.get(&id).expect("template sent first");
                        let mut off = 0;
                        while off < body.len() {
                            // Fixed-length values as integers; variable-length ones (a
                            // length byte first) as text.
                            let mut values = Vec::new();
                            let mut text = String::new();
                            for &(ie, l) in fields {
                                let l = if l == VARIABLE_LENGTH {
                                    off += 1;
                                    let n = usize::from(body[off - 1]);
                                    text = String::from_utf8(body[off..off + n].to_vec())
                                        .expect("UTF-8");
                                    off += n;
                                    continue;
                                } else {
                                    usize::from(l)
                                };
                                let v = body[off..off + l]
                                    .iter()
                                    .fold(0u128, |a, &x| a << 8 | u128::from(x));
                                off += l;
                                values.push((ie, v));
                            }
                            match id {
                                TEMPLATE_SELECTOR => {}
                                TEMPLATE_INTERFACES => self.names.push((values[0].1, text)),
                                _ => self.records.push(values),
                            }
                            self.counted += 1;
                        }
                    }
                }
                at += len;
            }
        }
    }

    /// What the export must carry of a record, in information elements.
    fn expected(r: &FlowRecord) -> Vec<(u16, u128)> {
        let k = &r.key;
        let (src, dst) = if k.v6 { (27, 28) } else { (8, 12) };
        let mut v = vec![
            (1, u128::from(r.bytes)),
            (2, u128::from(r.packets)),
            (152, u128::from(r.first_ns / 1_000_000)),
            (153, u128::from(r.last_ns / 1_000_000)),
            (10, u128::from(k.in_port) + 1),
            (14, r.out_port.map_or(0, |p| u128::from(p) + 1)),
            (4, u128::from(k.proto)),
            (src, k.src),
            (dst, k.dst),
            (7, u128::from(k.sport)),
            (11, u128::from(icmp_split(k).0)),
            (if k.v6 { 139 } else { 32 }, u128::from(icmp_split(k).1)),
            (6, u128::from(r.tcp_flags)),
            (233, u128::from(firewall_event(r))),
            (136, r.reason as u128),
            (351, k.vni.map_or(0, |n| 1 << 56 | u128::from(n))),
        ];
        if r.sampled {
            v.push((302, u128::from(SELECTOR_ID)));
        }
        v
    }

    fn record() -> impl Strategy<Value = FlowRecord> {
        let reason = prop_oneof![
            Just(EndReason::Idle),
            Just(EndReason::Active),
            Just(EndReason::EndOfFlow),
            Just(EndReason::Forced),
            Just(EndReason::LackOfResources)
        ];
        (
            (
                any::<bool>(),
                any::<u128>(),
                any::<u128>(),
                any::<u16>(),
                any::<u8>(),
            ),
            (
                any::<u16>(),
                any::<u16>(),
                proptest::option::of(0u32..1 << 24),
            ),
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                any::<u8>(),
            ),
            (
                proptest::option::of(any::<u16>()),
                any::<bool>(),
                reason,
                any::<bool>(),
            ),
        )
            .prop_map(|(addr, ports, counts, end)| {
                let (v6, src, dst, in_port, proto) = addr;
                let narrow = |a: u128| if v6 { a } else { a & 0xffff_ffff };
                FlowRecord {
                    key: FlowKey {
                        in_port,
                        v6,
                        src: narrow(src),
                        dst: narrow(dst),
                        proto,
                        sport: ports.0,
                        dport: ports.1,
                        vni: ports.2,
                    },
                    first_ns: counts.0,
                    last_ns: counts.1,
                    packets: counts.2,
                    bytes: counts.3,
                    tcp_flags: counts.4,
                    out_port: end.0,
                    denied: end.1,
                    reason: end.2,
                    sampled: end.3,
                }
            })
    }

    proptest! {
        /// Whatever the records, ports and message size, a decoder that knows only what
        /// the messages say reads every record and interface name back, with sequence
        /// numbers counting the records before each message and no message over the
        /// size.
        #[test]
        fn records_decode_back_from_their_templates(
            records in proptest::collection::vec(record(), 0..120),
            max in 0usize..1500,
            sampling in prop_oneof![Just(1u32), 2u32..1000],
            ports in proptest::collection::vec("[a-z][a-z0-9_]{0,20}|x{250,300}", 0..40),
        ) {
            let records: Vec<FlowRecord> = records
                .into_iter()
                .map(|r| FlowRecord { sampled: r.sampled && sampling > 1, ..r })
                .collect();
            let mut e = Exporter::new(9, max, 600, sampling).naming(ports.clone());
            let mut d = Decoder {
                templates: Default::default(),
                records: Vec::new(),
                names: Vec::new(),
                counted: 0,
            };
            for m in e.all_messages(&records, 1000) {
                d.message(&m, max.max(MIN_MESSAGE));
            }
            let mut got = d.records;
            let mut want: Vec<Vec<(u16, u128)>> = records.iter().map(expected).collect();
            got.sort();
            want.sort();
            prop_assert_eq!(got, want);
            let named: Vec<(u128, String)> = ports
                .iter()
                .enumerate()
                .map(|(i, p)| (i as u128 + 1, p[..p.len().min(254)].to_owned()))
                .collect();
            prop_assert_eq!(d.names, named);
            prop_assert_eq!(e.sequence(), d.counted);
        }
    }
}
