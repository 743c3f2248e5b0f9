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
    /// Per new pipe.
    pipes: Vec<PipeFrom>,
    /// Per new meter: the old meter.
    meters: Vec<Option<usize>>,
}

/// Where a new pipe's counters were.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PipeFrom {
    /// A pipe of the same name with the same entries in the same order: its counters as
    /// they are. (A reload mostly leaves large tables alone, and naming a million entries
    /// to find each again takes seconds.)
    Same(usize),
    /// Per entry: the entry of the same name in the old pipe of the same name.
    Entries(Vec<Option<(usize, usize)>>),
}

impl Renumbering {
    /// From `old`'s counters to `new`'s. The two have the same ports and services (a
    /// pipeline that changes those needs a restart), whose counters keep their places.
    pub fn between(old: &Program, new: &Program) -> Renumbering {
        let named = |name: &str| old.pipes.iter().position(|o| o.name == name);
        let pipes = new
            .pipes
            .iter()
            .map(|pipe| match named(&pipe.name) {
                Some(pi) if old.pipes[pi].body == pipe.body => PipeFrom::Same(pi),
                Some(pi) => {
                    let was: HashMap<String, usize> = old.pipes[pi]
                        .entry_names()
                        .into_iter()
                        .enumerate()
                        .map(|(ei, name)| (name, ei))
                        .collect();
                    let names = pipe.entry_names();
                    PipeFrom::Entries(names.iter().map(|n| Some((pi, *was.get(n)?))).collect())
                }
                None => PipeFrom::Entries(vec![None; pipe.body.len() + 1]),
            })
            .collect();
        let meters = new
            .meters
            .iter()
            .map(|m| old.meters.iter().position(|o| o.name == m.name))
            .collect();
        Renumbering { pipes, meters }
    }

    /// `old`'s counts in the new program's places: ports and services as they were, each
    /// entry and meter from where it was, zero where it is new. An unchanged pipe's
    /// counters are moved, not copied.
    pub fn stats(&self, mut old: Stats) -> Stats {
        let moved: Vec<Vec<Counter>> = self
            .pipes
            .iter()
            .map(|from| match from {
                PipeFrom::Same(pi) => old.entries.get_mut(*pi).map(std::mem::take),
                PipeFrom::Entries(_) => None,
            })
            .map(Option::unwrap_or_default)
            .collect();
        let entries = self
            .pipes
            .iter()
            .zip(moved)
            .map(|(from, moved)| match from {
                PipeFrom::Same(_) => moved,
                PipeFrom::Entries(each) => each
                    .iter()
                    .map(|e| {
                        e.and_then(|(pi, ei)| old.entries.get(pi)?.get(ei).copied())
                            .unwrap_or_default()
                    })
                    .collect(),
            })
            .collect();
        let meters = self
            .meters
            .iter()
            .map(|from| from.and_then(|i| old.meters.get(i).copied()))
            .map(|m| m.unwrap_or([0; 3]))
            .collect();
        Stats {
            entries,
            meters,
            ports: old.ports,
            services: old.services,
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
        rt.stats = renumbering.stats(std::mem::take(&mut rt.stats));
        rt.meters = f.meters.clone();
        rt.errors.tunnels.clone_from(&code.tunnels);
        rt.errors.addresses = code.addresses.clone();
        if f.mirrors && rt.mirrors.is_empty() {
            rt.mirrors = super::mirror_pool();
        }
        if let (Some(ct), Some(c)) = (rt.ct.as_mut(), f.conntrack.as_ref()) {
            ct.retune(c);
        }
        // Entries the old program's root pipes found for the last part: a program without
        // batched roots never clears them, and would take them as its own.
        self.root_entries.fill(None);
        self.code = code;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PacketBuf;
    use crate::engine::TREE_MIN_RULES;
    use crate::ir::PortId;
    use crate::lang::check_source;
    use proptest::prelude::*;

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

    /// A reload from a root pipe whose packets are classified a part at a time (a rule
    /// tree) to one classified packet by packet: the next packets are decided by the new
    /// rules, not by the entries the old tree found for the last part's packets.
    #[test]
    fn entries_the_old_program_found_are_not_taken_after_a_reload() {
        let rules: String = (0..TREE_MIN_RULES as u16 + 8)
            .map(|i| format!("rule r{i} {{ match udp.dst {} actions fwd b }}\n", 1000 + i))
            .collect();
        let old = program(&format!(
            "pipe f root from a {{\n{rules}default {{ actions drop }}\n}}\n"
        ));
        let new = program(
            "pipe f root from a {\n\
             rule dns { match udp.dst 53 actions fwd b }\n\
             default { actions drop }\n}\n",
        );
        let mut engine = Engine::new(&old);
        let last = 1000 + TREE_MIN_RULES as u16 + 7;
        let mut batch = vec![udp_to(last)];
        engine.process(&mut batch, &mut crate::engine::NoObserver);
        assert_eq!(batch[0].verdict, crate::engine::Verdict::Forward(PortId(1)));
        engine.reload(
            Arc::new(super::super::Compiled::new(&new)),
            &Renumbering::between(&old, &new),
        );
        let mut batch = vec![udp_to(last), udp_to(53)];
        engine.process(&mut batch, &mut crate::engine::NoObserver);
        assert!(matches!(batch[0].verdict, crate::engine::Verdict::Drop(_)));
        assert_eq!(batch[1].verdict, crate::engine::Verdict::Forward(PortId(1)));
        let s = engine.stats();
        assert_eq!([s.entries[0][0].packets, s.entries[0][1].packets], [1, 1]);
    }

    /// A pipe left as it was keeps its counters as they are (moved, whatever its size); a
    /// pipe renamed is a new pipe.
    #[test]
    fn unchanged_pipes_keep_their_counters_and_renamed_ones_start_afresh() {
        let pipes = |second: &str| {
            program(&format!(
                "pipe f root from a {{\n\
                 table exact udp.dst {{ 53 => fwd b\n 80 => fwd b }}\n\
                 default {{ actions drop }}\n}}\n\
                 pipe {second} root from b {{ default {{ actions fwd a }} }}\n"
            ))
        };
        let (old, new) = (pipes("g"), pipes("h"));
        let r = Renumbering::between(&old, &new);
        let counted = |n: u64| Counter {
            packets: n,
            bytes: 100 * n,
        };
        let before = Stats {
            entries: vec![vec![counted(1), counted(2), counted(3)], vec![counted(4)]],
            ..Stats::default()
        };
        let after = r.stats(before.clone());
        assert_eq!(after.entries[0], before.entries[0]);
        assert_eq!(after.entries[1], vec![Counter::default()]);
    }

    /// A pipe of rules named `r{i}` for each `i` of `names`, in that order, each matching
    /// its own UDP port.
    fn rules_pipe(names: &[u8]) -> String {
        let rules: String = names
            .iter()
            .map(|i| {
                format!(
                    "rule r{i} {{ match udp.dst {} actions fwd b }}\n",
                    1000 + u16::from(*i)
                )
            })
            .collect();
        format!("pipe f root from a {{\n{rules}default {{ actions drop }}\n}}\n")
    }

    proptest! {
        /// Whatever the old and new rules, each new rule's counter is the old rule's of the
        /// same name, or zero if it is new; the default's carries; ports carry.
        #[test]
        fn every_counter_comes_from_its_namesake(
            old_names in proptest::sample::subsequence((0u8..12).collect::<Vec<_>>(), 0..12),
            new_names in proptest::sample::subsequence((0u8..12).collect::<Vec<_>>(), 0..12)
                .prop_shuffle(),
        ) {
            let (old, new) = (program(&rules_pipe(&old_names)), program(&rules_pipe(&new_names)));
            let counted = |i: usize| Counter { packets: i as u64 + 1, bytes: 64 * (i as u64 + 1) };
            let before = Stats {
                ports: vec![crate::engine::PortStats::default(); 2],
                entries: vec![(0..=old_names.len()).map(counted).collect()],
                ..Stats::default()
            };
            let after = Renumbering::between(&old, &new).stats(before.clone());
            prop_assert_eq!(after.entries[0].len(), new_names.len() + 1);
            for (ni, name) in new_names.iter().enumerate() {
                let want = old_names
                    .iter()
                    .position(|o| o == name)
                    .map_or(Counter::default(), counted);
                prop_assert_eq!(after.entries[0][ni], want);
            }
            prop_assert_eq!(after.entries[0][new_names.len()], counted(old_names.len()));
            prop_assert_eq!(after.ports, before.ports);
        }
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
        assert_eq!(r.stats(before).meters, vec![[5, 6, 7], [0, 0, 0]]);
    }
}
