//! The addresses a pipeline answers for, which the service announces out of the port each
//! answer leaves by when that port opens: an ARP Announcement (RFC 5227 §2.3) or an
//! unsolicited Neighbor Advertisement (RFC 4861 §7.2.6). A neighbour that holds another
//! hardware address for one (the address moved here from another gateway, or this one's
//! MAC changed) takes the new one at once, rather than sending to the old one until its
//! entry goes stale and is probed again.

use super::{Action, FieldId, PipeBody, Program, Rule};
use std::net::{Ipv4Addr, Ipv6Addr};

/// An address a rule answers for, with the hardware address it answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announcement {
    /// `arp.reply MAC` in a rule that matches one `arp.tpa`.
    Arp { ip: Ipv4Addr, mac: [u8; 6] },
    /// `nd.advert MAC [router]` in a rule that matches one `nd.target`.
    Nd {
        ip: Ipv6Addr,
        mac: [u8; 6],
        router: bool,
    },
}

impl Program {
    /// What each port (by index) announces: the answers of rules that match one target
    /// address and end in `fwd` to that port, in the pipes' and rules' order, each once.
    /// A table's entries are not announced, nor a rule's that answers for a prefix.
    pub fn announcements(&self) -> Vec<Vec<Announcement>> {
        let mut by_port = vec![Vec::new(); self.ports.len()];
        let rules = self.pipes.iter().filter_map(|p| match &p.body {
            PipeBody::Rules(rules) => Some(rules),
            _ => None,
        });
        for rule in rules.flatten() {
            let Action::Fwd(port) = *rule.actions.terminal() else {
                continue;
            };
            let Some(list) = by_port.get_mut(port.index()) else {
                continue;
            };
            for action in &rule.actions.0 {
                let announced = match *action {
                    Action::ArpReply(mac) => target(rule, FieldId::ArpTpa).map(|ip| {
                        let ip = Ipv4Addr::from(ip as u32);
                        Announcement::Arp { ip, mac }
                    }),
                    Action::NdAdvert { mac, router } => {
                        target(rule, FieldId::NdTarget).map(|ip| Announcement::Nd {
                            ip: Ipv6Addr::from(ip),
                            mac,
                            router,
                        })
                    }
                    _ => None,
                };
                if let Some(a) = announced.filter(|a| !list.contains(a)) {
                    list.push(a);
                }
            }
        }
        by_port
    }
}

/// The one value `rule` matches its outer field `id` with, if it matches one.
fn target(rule: &Rule, id: FieldId) -> Option<u128> {
    let m = rule
        .matches
        .iter()
        .find(|m| m.field.id == id && !m.field.inner)?;
    let (lo, hi) = m.pattern.interval(m.field.kind())?;
    (lo == hi).then_some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lang::check_source;
    use std::path::Path;

    /// Rules answering for one address announce it out of the port they answer by; a rule
    /// answering for a prefix, and one that does not answer, announce nothing.
    #[test]
    fn rules_answering_for_one_address_announce_it() {
        let c = check_source(
            "t.pipe",
            "pipeline p\nport a { driver pcap }\nport b { driver pcap }\n\
             pipe x root from a {\n\
               rule arp { match arp.op 1  arp.tpa 192.0.2.1  actions arp.reply 02:00:00:00:00:01, fwd b }\n\
               rule many { match arp.op 1  arp.tpa 192.0.2.0/24  actions arp.reply 02:00:00:00:00:02, fwd b }\n\
               rule nd { match icmp6.type 135  nd.target 2001:db8::1\n\
                         actions nd.advert 02:00:00:00:00:03 router, fwd a }\n\
               rule again { match arp.op 1  arp.tpa 192.0.2.1  actions arp.reply 02:00:00:00:00:01, fwd b }\n\
               rule other { match arp.tpa 192.0.2.9  actions fwd b }\n\
               default { actions drop }\n\
             }",
            Path::new("."),
        );
        let p = c.program.expect("valid");
        assert_eq!(
            p.announcements(),
            [
                vec![Announcement::Nd {
                    ip: "2001:db8::1".parse().unwrap(),
                    mac: [2, 0, 0, 0, 0, 3],
                    router: true,
                }],
                vec![Announcement::Arp {
                    ip: Ipv4Addr::new(192, 0, 2, 1),
                    mac: [2, 0, 0, 0, 0, 1],
                }],
            ]
        );
    }
}
