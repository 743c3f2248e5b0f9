//! A service that is one node of a Redis Cluster of services (`cluster_node`), as
//! cluster clients see one: the 16384 hash slots dealt out to the nodes in the order the
//! pipeline file lists them, a request for a key of another node's slot answered
//! `MOVED` to that node, keys of different slots in one request refused (`CROSSSLOT`),
//! and `CLUSTER SLOTS`, `SHARDS`, `NODES`, `INFO`, `MYID` and `KEYSLOT` as Redis 7.0
//! answers them (Redis Cluster Specification, "Key distribution model" and
//! "Redirection and resharding"). Each node keeps its own slots' keys on its own
//! target. The slots are fixed by the file: no slot moved by a command, no replicas, no
//! cluster bus; keys a node holds of slots the file now gives another node are handed to
//! it when the node starts or reloads the file (`handoff`), all of them by a node leaving
//! the cluster.

use crate::kvcache::resp::{reply, Proto};
use std::net::SocketAddr;

/// Hash slots of a cluster.
pub const SLOTS: usize = 16384;

/// The nodes of the cluster and which one this service is.
#[derive(Debug)]
pub struct Cluster {
    nodes: Vec<SocketAddr>,
    /// This service's place among `nodes`; `None` for a node leaving the cluster, which
    /// serves no slot.
    me: Option<usize>,
    /// Each node's 40-character id, the same on every node.
    ids: Vec<String>,
    /// This service's address and id.
    my_address: SocketAddr,
    my_id: String,
}

impl Cluster {
    /// The cluster of `nodes` as the node listening at `me`, one of them unless it is
    /// `leaving`; `None` when there are none (a standalone service), or `me` is not one
    /// of them and not leaving.
    pub fn new(nodes: &[SocketAddr], me: SocketAddr, leaving: bool) -> Option<Cluster> {
        let at = nodes.iter().position(|n| *n == me);
        if nodes.is_empty() || (at.is_none() && !leaving) {
            return None;
        }
        Some(Cluster {
            nodes: nodes.to_vec(),
            me: at,
            ids: nodes.iter().map(node_id).collect(),
            my_address: me,
            my_id: node_id(&me),
        })
    }

    /// The first slot of node `i`; `i` = the number of nodes gives one past the last slot.
    fn first_slot(&self, i: usize) -> usize {
        i * SLOTS / self.nodes.len()
    }

    /// The node serving `slot`.
    fn owner(&self, slot: usize) -> usize {
        let mut i = slot * self.nodes.len() / SLOTS;
        while self.first_slot(i + 1) <= slot {
            i += 1;
        }
        while self.first_slot(i) > slot {
            i -= 1;
        }
        i
    }

    /// Whether this node serves `key`'s slot.
    pub fn owns(&self, key: &[u8]) -> bool {
        Some(self.owner(slot(key))) == self.me
    }

    /// The node serving `key`'s slot.
    pub fn node_of(&self, key: &[u8]) -> SocketAddr {
        self.nodes[self.owner(slot(key))]
    }

    /// Whether this node serves all of `keys` in one request: they are of one of its slots.
    pub fn serves_all(&self, keys: &[&[u8]]) -> bool {
        let first = keys.first().map_or(0, |k| slot(k));
        Some(self.owner(first)) == self.me && keys.iter().all(|k| slot(k) == first)
    }

    /// What to answer instead of serving a request of `words` whose keys are at `places`:
    /// `CROSSSLOT` when they are not all of one slot, `MOVED` to the node serving it when
    /// that is not this one; `None` to serve it.
    pub fn redirect(
        &self,
        words: &[&[u8]],
        mut places: impl Iterator<Item = usize>,
    ) -> Option<String> {
        let first = slot(words[places.next()?]);
        if places.any(|p| slot(words[p]) != first) {
            return Some("CROSSSLOT Keys in request don't hash to the same slot".into());
        }
        let owner = self.owner(first);
        (Some(owner) != self.me).then(|| {
            let node = self.nodes[owner];
            format!("MOVED {first} {}:{}", node.ip(), node.port())
        })
    }

    /// This node's id (`CLUSTER MYID`).
    pub fn my_id(&self) -> &str {
        &self.my_id
    }

    /// `CLUSTER INFO`: every slot served, by as many nodes as are listed, this one known
    /// too when it is leaving.
    pub fn info(&self) -> String {
        let n = self.nodes.len();
        let known = n + usize::from(self.me.is_none());
        format!(
            "cluster_state:ok\r\ncluster_slots_assigned:{SLOTS}\r\ncluster_slots_ok:{SLOTS}\r\n\
             cluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:{known}\r\n\
             cluster_size:{n}\r\ncluster_current_epoch:0\r\ncluster_my_epoch:0\r\n\
             cluster_stats_messages_sent:0\r\ncluster_stats_messages_received:0\r\n\
             total_cluster_links_buffer_limit_exceeded:0\r\n"
        )
    }

    /// `CLUSTER NODES`: a line a node, its id, address (no cluster bus: port 0), flags,
    /// and slots, every node connected; a node leaving, last, with no slots.
    pub fn nodes(&self) -> String {
        let mut lines = String::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let flags = if Some(i) == self.me {
                "myself,master"
            } else {
                "master"
            };
            let (first, last) = (self.first_slot(i), self.first_slot(i + 1) - 1);
            lines += &format!(
                "{} {}:{}@0 {flags} - 0 0 0 connected {first}-{last}\n",
                self.ids[i],
                node.ip(),
                node.port()
            );
        }
        if self.me.is_none() {
            let me = self.my_address;
            lines += &format!(
                "{} {}:{}@0 myself,master - 0 0 0 connected\n",
                self.my_id,
                me.ip(),
                me.port()
            );
        }
        lines
    }

    /// `CLUSTER SLOTS`: each node's range of slots, and the node: address, port, id and
    /// (none here) its other endpoints.
    pub fn slots(&self, out: &mut Vec<u8>, proto: Proto) {
        reply::array(out, self.nodes.len());
        for (i, node) in self.nodes.iter().enumerate() {
            reply::array(out, 3);
            reply::integer(out, self.first_slot(i) as i64);
            reply::integer(out, self.first_slot(i + 1) as i64 - 1);
            reply::array(out, 4);
            reply::bulk(out, node.ip().to_string().as_bytes());
            reply::integer(out, i64::from(node.port()));
            reply::bulk(out, self.ids[i].as_bytes());
            reply::map(out, 0, proto);
        }
    }

    /// `CLUSTER SHARDS`: a shard a node, its slots and itself, the master, online.
    pub fn shards(&self, out: &mut Vec<u8>, proto: Proto) {
        reply::array(out, self.nodes.len());
        for (i, node) in self.nodes.iter().enumerate() {
            reply::map(out, 2, proto);
            reply::bulk(out, b"slots");
            reply::array(out, 2);
            reply::integer(out, self.first_slot(i) as i64);
            reply::integer(out, self.first_slot(i + 1) as i64 - 1);
            reply::bulk(out, b"nodes");
            reply::array(out, 1);
            reply::map(out, 7, proto);
            let ip = node.ip().to_string();
            reply::bulk(out, b"id");
            reply::bulk(out, self.ids[i].as_bytes());
            reply::bulk(out, b"port");
            reply::integer(out, i64::from(node.port()));
            for (field, value) in [("ip", ip.as_str()), ("endpoint", &ip), ("role", "master")] {
                reply::bulk(out, field.as_bytes());
                reply::bulk(out, value.as_bytes());
            }
            reply::bulk(out, b"replication-offset");
            reply::integer(out, 0);
            reply::bulk(out, b"health");
            reply::bulk(out, b"online");
        }
    }
}

/// The hash slot of `key`: CRC16 (XMODEM) of the key, or of its hash tag — what is
/// between its first `{` and the first `}` after it, when that is not empty — modulo
/// 16384 (Redis Cluster Specification, "Hash tags").
pub fn slot(key: &[u8]) -> usize {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let inner = &key[open + 1..];
        let close = inner.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &inner[..close])
    });
    usize::from(crc16(tagged.unwrap_or(key))) % SLOTS
}

/// CRC16-CCITT as XMODEM has it: polynomial 0x1021, initial value 0, no reflection.
fn crc16(bytes: &[u8]) -> u16 {
    bytes.iter().fold(0u16, |crc, &b| {
        let i = usize::from((crc >> 8) as u8 ^ b);
        (crc << 8) ^ CRC16_TABLE[i]
    })
}

/// [`crc16`]'s value of each byte.
const CRC16_TABLE: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

/// A node's id: 40 hex digits drawn from its address (FNV-1a, three ways, each mixed as
/// SplitMix64 finishes), so that every node, whatever its build, names every other the
/// same.
fn node_id(addr: &SocketAddr) -> String {
    let text = addr.to_string();
    let mut id = String::with_capacity(48);
    for seed in [
        0xcbf2_9ce4_8422_2325_u64,
        0x8422_2325_cbf2_9ce4,
        0x9e37_79b9_7f4a_7c15,
    ] {
        let mut h = text.bytes().fold(seed, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
        h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        id += &format!("{:016x}", h ^ (h >> 31));
    }
    id.truncate(40);
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_clusters() {
        // The specification's check value of CRC16/XMODEM.
        assert_eq!(crc16(b"123456789"), 0x31c3);
        assert_eq!(slot(b"123456789"), 0x31c3 % SLOTS);
        assert_eq!(slot(b"foo"), 12182);
        // Hash tags, the specification's examples.
        assert_eq!(slot(b"{user1000}.following"), slot(b"user1000"));
        assert_eq!(
            slot(b"foo{}{bar}"),
            usize::from(crc16(b"foo{}{bar}")) % SLOTS
        );
        assert_eq!(slot(b"foo{{bar}}zap"), slot(b"{bar"));
        assert_eq!(slot(b"foo{bar}{zap}"), slot(b"bar"));
    }

    #[test]
    fn every_slot_has_one_node_and_each_node_a_run_of_them() {
        let addr = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        for n in [1, 2, 3, 5, 7, 1000] {
            let nodes: Vec<SocketAddr> = (0..n).map(|i| addr(7000 + i)).collect();
            let c = Cluster::new(&nodes, nodes[0], false).expect("a node of it");
            let mut served = vec![0; usize::from(n)];
            let mut last = 0;
            for s in 0..SLOTS {
                let o = c.owner(s);
                assert!(o == last || o == last + 1, "{n} nodes: slot {s}");
                assert!((c.first_slot(o)..c.first_slot(o + 1)).contains(&s));
                served[o] += 1;
                last = o;
            }
            assert!(served.iter().all(|&k| k >= SLOTS / usize::from(n)), "{n}");
            let ids: std::collections::HashSet<&String> = c.ids.iter().collect();
            assert_eq!(ids.len(), usize::from(n));
            assert!(c.ids.iter().all(|id| id.len() == 40));
        }
        assert!(Cluster::new(&[addr(1)], addr(2), false).is_none());
        assert!(Cluster::new(&[], addr(2), true).is_none());
    }

    #[test]
    fn a_node_leaving_serves_no_slot_and_says_so() {
        let addr = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
        let c = Cluster::new(&[addr(1), addr(2)], addr(3), true).expect("leaving");
        assert!((0..2000u32).all(|i| !c.owns(format!("k{i}").as_bytes())));
        assert_eq!(
            c.redirect(&[b"GET", b"foo"], [1].into_iter()),
            Some("MOVED 12182 127.0.0.1:2".into())
        );
        let nodes = c.nodes();
        let mine = format!(
            "{} 127.0.0.1:3@0 myself,master - 0 0 0 connected\n",
            c.my_id()
        );
        assert!(
            nodes.ends_with(&mine) && nodes.lines().count() == 3,
            "{nodes}"
        );
        assert!(!c.ids.contains(&c.my_id().to_owned()));
        assert!(c
            .info()
            .contains("cluster_known_nodes:3\r\ncluster_size:2\r\n"));
    }
}
