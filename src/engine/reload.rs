//! Taking a reloaded program between batches: the new compiled code replaces the old, and
//! the state that outlives a reload stays — connections, flows, port counters — while
//! rule and meter counters follow their rule or meter by name.

use super::{Counter, Engine, Stats};
use crate::ir::Program;
use std::collections::HashMap;
use std::sync::Arc;

/// Where each counter of a new program was in the program before it, by pipe and entry
/// name (rule names, table keys, `default`) and by meter name; `None` for what is new.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Renumbering {
    /// Per new pipe, per entry: the old pipe and entry.
    entries: Vec<Vec<Option<(usize, usize)>>>,
    /// Per new meter: the old meter.
    meters: Vec<Option<usize>>,
}

impl Renumbering {
    /// From `old`'s counters to `new`'s. The two have the same ports and services (a
    /// pipeline that changes those needs a restart), whose counters keep their places.
    pub fn between(old: &Program, new: &Program) -> Renumbering {
        let mut was = HashMap::new();
        let old_names: Vec<Vec<String>> = old.pipes.iter().map(|p| p.entry_names()).collect();
        for (pi, (pipe, names)) in old.pipes.iter().zip(&old_names).enumerate() {
            for (ei, name) in names.iter().enumerate() {
                was.insert((pipe.name.as_str(), name.as_str()), (pi, ei));
            }
        }
        let entries = new
            .pipes
            .iter()
            .map(|pipe| {
                pipe.entry_names()
                    .iter()
                    .map(|name| was.get(&(pipe.name.as_str(), name.as_str())).copied())
                    .collect()
            })
            .collect();
        let meters = new
            .meters
            .iter()
            .map(|m| old.meters.iter().position(|o| o.name == m.name))
            .collect();
        Renumbering { entries, meters }
    }

    /// `old`'s counts in the new program's places: ports and services as they were, each
    /// entry and meter from where it was, zero where it is new.
    pub fn stats(&self, old: &Stats) -> Stats {
        let entry = |&(pi, ei): &(usize, usize)| {
            old.entries
                .get(pi)
                .and_then(|e| e.get(ei))
                .copied()
                .unwrap_or_default()
        };
        Stats {
            ports: old.ports.clone(),
            entries: self
                .entries
                .iter()
                .map(|pipe| {
                    pipe.iter()
                        .map(|from| from.as_ref().map_or(Counter::default(), entry))
                        .collect()
                })
                .collect(),
            meters: self
                .meters
                .iter()
                .map(|from| {
                    from.and_then(|i| old.meters.get(i).copied())
                        .unwrap_or([0; 3])
                })
                .collect(),
            services: old.services.clone(),
        }
    }
}

impl Engine {
    /// Runs `code` from the next batch on, its counters carried over by `renumbering`
    /// (from the program this engine ran). Connections and flows are kept, under the new
    /// program's timeouts; meters start full (their buckets are the new program's).
    pub fn reload(&mut self, code: Arc<super::Compiled>, renumbering: &Renumbering) {
        let f = &code.fresh;
        let rt = &mut self.rt;
        rt.stats = renumbering.stats(&rt.stats);
        rt.meters = f.meters.clone();
        if f.mirrors && rt.mirrors.is_empty() {
            rt.mirrors = super::mirror_pool();
        }
        if let (Some(ct), Some(c)) = (rt.ct.as_mut(), f.conntrack.as_ref()) {
            ct.retune(c);
        }
        self.code = code;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PacketBuf;
    use crate::ir::PortId;
    use crate::lang::check_source;

    fn program(body: &str) -> Program {
        let text = format!(
            "pipeline p\nport a {{ driver pcap }}\nport b {{ driver pcap }}\n\
             meter m {{ rate 1gbps burst 1mb }}\n{body}"
        );
        check_source("p.pipe", &text, std::path::Path::new("."))
            .program
            .expect("valid")
    }

    fn udp_to(dport: u16) -> PacketBuf {
        let frame =
            crate::wire::testing::frame(false, 1, 2, crate::wire::ip_proto::UDP, 9, dport, 0, 0);
        let mut b = PacketBuf::new(crate::engine::DEFAULT_MAX_FRAME);
        assert!(b.load(&frame, PortId(0), 0));
        b
    }

    /// Counters follow their rule by name; a rule new to the pipeline starts at zero; the
    /// port counters go on; and the new rules decide from the next batch.
    #[test]
    fn counters_follow_rules_by_name_and_new_rules_decide() {
        let old = program(
            "pipe f root from a {\n\
             rule dns { match udp.dst 53 actions fwd b }\n\
             rule web { match udp.dst 80 actions fwd b }\n\
             default { actions drop }\n}\n",
        );
        let new = program(
            "pipe f root from a {\n\
             rule ntp { match udp.dst 123 actions fwd b }\n\
             rule web { match udp.dst 80 actions drop }\n\
             rule dns { match udp.dst 53 actions fwd b }\n\
             default { actions drop }\n}\n",
        );
        let mut engine = Engine::new(&old);
        let mut batch = vec![udp_to(53), udp_to(80), udp_to(80), udp_to(123)];
        engine.process(&mut batch, &mut crate::engine::NoObserver);
        let r = Renumbering::between(&old, &new);
        engine.reload(Arc::new(super::super::Compiled::new(&new)), &r);
        let s = engine.stats();
        let packets = |e: usize| s.entries[0][e].packets;
        // ntp, web, dns, default.
        assert_eq!(
            [packets(0), packets(1), packets(2), packets(3)],
            [0, 2, 1, 1]
        );
        assert_eq!(s.ports[0].rx.packets, 4);

        let mut batch = vec![udp_to(80), udp_to(123)];
        engine.process(&mut batch, &mut crate::engine::NoObserver);
        assert!(matches!(batch[0].verdict, crate::engine::Verdict::Drop(_)));
        assert_eq!(batch[1].verdict, crate::engine::Verdict::Forward(PortId(1)));
        let s = engine.stats();
        assert_eq!([s.entries[0][0].packets, s.entries[0][1].packets], [1, 3]);
        assert_eq!(s.ports[0].rx.packets, 6);
    }

    #[test]
    fn meters_follow_by_name_and_new_ones_start_at_zero() {
        let old = program("pipe f root from a { default { actions fwd b } }\n");
        let new = program(
            "meter n { rate 1000 pps  burst 50 }\n\
             pipe f root from a { default { actions fwd b } }\n",
        );
        let r = Renumbering::between(&old, &new);
        let before = Stats {
            meters: vec![[5, 6, 7]],
            ..Stats::default()
        };
        assert_eq!(r.stats(&before).meters, vec![[5, 6, 7], [0, 0, 0]]);
    }
}
