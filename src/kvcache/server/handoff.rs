//! Keys handed to their new node when a cluster's node list changes (`cluster_node`). A
//! node that starts with saved keys of hash slots the list now gives another node, or
//! holds them when a reload of its pipeline file (SIGHUP) changes the list, sends each
//! to that node as a client of it would (`SET key value NX`, with its deadline as
//! `PXAT`), and forgets it once taken: a cluster that grows by a node keeps its cache
//! rather than losing the keys of every slot that changed hands. A node leaving the
//! cluster (`cluster_leaving`) serves no slot, so it hands over all its keys.
//!
//! Until a key is taken it stays here, unserved: a request for it is answered `MOVED` to
//! its node, which misses it meanwhile (as a slot's keys stay on the node the slot
//! migrates from in Redis until `MIGRATE` moves them). `NX` keeps the value the new node
//! may have been given meanwhile, which is newer. A node that does not take them yet (it
//! has not started, or still has the old list and answers `MOVED`) is tried again while
//! this one runs, less often the longer it refuses; the keys waiting are saved with the
//! index, and go first to make room when it runs short, least recently used as they are.

use super::cluster::Cluster;
use super::peer::{Answer, Peer};
use super::{KvService, POLL};
use crate::kvcache::index::{Extents, Index};
use crate::kvcache::resp::reply;
use rustls::pki_types::ServerName;
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// The longest wait for a connection to another node, and for its replies.
const PEER_TIMEOUT: Duration = Duration::from_secs(10);
/// The wait before trying a node again, doubled after each round it took nothing, up to
/// [`LONGEST_RETRY`].
const FIRST_RETRY: Duration = Duration::from_secs(1);
const LONGEST_RETRY: Duration = Duration::from_secs(60);
/// Requests sent to a node before their replies are read: at most so many keys, and about
/// so many bytes.
const BATCH_KEYS: usize = 64;
const BATCH_BYTES: usize = 8 << 20;

/// The hand-off under way as one word, so that one a later node-list change superseded
/// cannot touch the count of the one after it: its round (the high bits: one a change)
/// and the keys it still has to hand over (the low [`Handoffs::COUNT_BITS`]; the
/// `dpuflow_kvcache_handoff_keys` gauge).
#[derive(Debug, Default)]
pub struct Handoffs(AtomicU64);

impl Handoffs {
    const COUNT_BITS: u32 = 40;
    const COUNT: u64 = (1 << Self::COUNT_BITS) - 1;

    /// Begins the next round, which supersedes the one before; the keys still count as
    /// waiting until [`Handoffs::waiting_for`] counts them afresh. Returns the round.
    pub(super) fn begin(&self) -> u64 {
        let step = 1 << Self::COUNT_BITS;
        (self.0.fetch_add(step, Relaxed).wrapping_add(step)) >> Self::COUNT_BITS
    }

    /// The round under way.
    pub(super) fn round(&self) -> u64 {
        self.0.load(Relaxed) >> Self::COUNT_BITS
    }

    /// Keys held of slots other nodes serve, not yet handed over.
    pub fn waiting(&self) -> u64 {
        self.0.load(Relaxed) & Self::COUNT
    }

    /// Changes the count of `round`, if it is still the one under way.
    fn update(&self, round: u64, count: impl Fn(u64) -> u64) {
        let _ = self.0.fetch_update(Relaxed, Relaxed, |word| {
            (word >> Self::COUNT_BITS == round)
                .then(|| word & !Self::COUNT | count(word & Self::COUNT).min(Self::COUNT))
        });
    }

    /// `round` has `keys` to hand over.
    pub(super) fn waiting_for(&self, round: u64, keys: u64) {
        self.update(round, |_| keys);
    }

    /// One key of `round` is no longer waiting: taken, or gone.
    fn one_less(&self, round: u64) {
        self.update(round, |n| n.saturating_sub(1));
    }
}

/// The keys to hand over, by the node they go to.
pub(super) type Pending = Vec<(SocketAddr, Vec<Arc<[u8]>>)>;

/// The keys `index` holds of slots another node of `cluster` serves, by that node.
pub(super) fn strangers(index: &Index, cluster: &Cluster) -> Pending {
    let mut by_node: BTreeMap<SocketAddr, Vec<Arc<[u8]>>> = BTreeMap::new();
    for key in index.keys_where(|k| !cluster.owns(k)) {
        by_node.entry(cluster.node_of(&key)).or_default().push(key);
    }
    by_node.into_iter().collect()
}

/// Removes the keys of `pending` from `index`, where the service speaks TLS with nothing
/// to verify the other nodes with (no `tls_client_ca`): kept, they would only take room.
pub(super) fn drop_unverifiable(index: &mut Index, pending: &Pending, service: &str) {
    let keys = pending.iter().flat_map(|(_, keys)| keys);
    for key in keys.clone() {
        index.remove(key);
    }
    tracing::warn!(service, keys = keys.count(),
        "kvcache: dropped the keys held of hash slots other cluster nodes serve (the `cluster_node` list changed): handing them over TLS needs `tls_client_ca` to verify the nodes");
}

/// `SET key value NX [PXAT deadline]` as a request's bytes, appended to `out`.
fn set_request(out: &mut Vec<u8>, key: &[u8], value: &[u8], deadline: Option<u64>) {
    let at = deadline.map(|d| d.to_string());
    reply::array(out, if at.is_some() { 6 } else { 4 });
    for word in [&b"SET"[..], key, value, b"NX"] {
        reply::bulk(out, word);
    }
    if let Some(at) = at {
        reply::bulk(out, b"PXAT");
        reply::bulk(out, at.as_bytes());
    }
}

/// Whether a node's error says it does not serve the key's slot yet (it still has the
/// node list before the change) or cannot take requests for a while, rather than
/// refusing the value.
fn not_yet(error: &str) -> bool {
    ["MOVED ", "ASK ", "TRYAGAIN", "CLUSTERDOWN", "LOADING"]
        .iter()
        .any(|p| error.starts_with(p))
}

impl KvService {
    /// Takes `nodes` as the cluster's node list from now on (this node `leaving` it, or
    /// not), as a reload of the pipeline file gives them: requests are redirected by the
    /// new list at once, and the keys held of slots it gives other nodes are handed to
    /// them as at a start. A hand-off under way stops; this one takes its keys too. The
    /// index is locked while its keys are looked through.
    pub fn regroup(self: &Arc<Self>, nodes: &[SocketAddr], leaving: bool) {
        let cluster = Cluster::new(nodes, self.config.listen, leaving).map(Arc::new);
        let handoffs = &self.counters.handoffs;
        let round = handoffs.begin();
        *self.cluster.write().unwrap_or_else(PoisonError::into_inner) = cluster.clone();
        let pending = match &cluster {
            Some(c) => strangers(&self.lock(), c),
            None => Vec::new(),
        };
        let waiting: usize = pending.iter().map(|(_, keys)| keys.len()).sum();
        let name = &self.name;
        tracing::info!(service = %name, nodes = nodes.len(), keys = waiting,
            "kvcache: the cluster's node list changed; keys of slots other nodes serve now go to them");
        if waiting > 0 && self.peer_tls().is_err() {
            drop_unverifiable(&mut self.lock(), &pending, name);
            handoffs.waiting_for(round, 0);
            return;
        }
        handoffs.waiting_for(round, waiting as u64);
        if waiting > 0 {
            let s = Arc::clone(self);
            let thread = std::thread::Builder::new()
                .name(format!("kv-{name}-handoff"))
                .spawn(move || s.hand_off(pending, round));
            if let Err(e) = thread {
                tracing::error!(service = %name, error = %e, "kvcache cannot start the hand-off");
            }
        }
    }

    /// Hands `pending` to their nodes, round after round, until every key is taken (or
    /// gone: evicted, expired, flushed), the service stops, or the node list changes
    /// again (the hand-off `round` is no longer the service's: another has begun, from
    /// the keys held then).
    pub(super) fn hand_off(&self, mut pending: Pending, round: u64) {
        let superseded = || self.counters.handoffs.round() != round;
        // The nodes that failed their last round, with the error logged.
        let mut failing: BTreeMap<SocketAddr, String> = BTreeMap::new();
        let mut wait = FIRST_RETRY;
        loop {
            let mut took = 0;
            for (node, keys) in &mut pending {
                if superseded() {
                    return;
                }
                let waiting = keys.len();
                match self.hand_to(*node, keys, round) {
                    Ok(n) => {
                        took += n;
                        if failing.remove(node).is_some() {
                            tracing::info!(service = %self.name, node = %node, keys = n,
                                "kvcache: the node takes the keys of its slots");
                        }
                    }
                    Err(e) => {
                        // Logged again only when the error changes: a node not up yet,
                        // then one that refuses our certificate, say.
                        let e = e.to_string();
                        if failing.get(node) != Some(&e) {
                            tracing::warn!(service = %self.name, node = %node, keys = waiting,
                                error = %e, "kvcache: keys of slots another node serves not handed to it yet; trying again");
                            failing.insert(*node, e);
                        }
                    }
                }
            }
            pending.retain(|(_, keys)| !keys.is_empty());
            if pending.is_empty() {
                if !superseded() {
                    self.counters.handoffs.waiting_for(round, 0);
                    tracing::info!(service = %self.name,
                        "kvcache: every key held of the slots other nodes serve is handed to its node");
                }
                return;
            }
            wait = if took > 0 {
                FIRST_RETRY
            } else {
                (wait * 2).min(LONGEST_RETRY)
            };
            let until = Instant::now() + wait;
            while Instant::now() < until {
                if self.stop.load(Relaxed) || superseded() {
                    return;
                }
                std::thread::sleep(POLL);
            }
        }
    }

    /// Sends `keys` to `node` and forgets those it takes; those it does not take yet stay
    /// in `keys`. How many it took; an error when it cannot be reached or a reply is
    /// missing, and, once the rest were sent, when it refused a key other than for
    /// [`not_yet`] or a value could not be read. `round` is the hand-off's.
    fn hand_to(&self, node: SocketAddr, keys: &mut Vec<Arc<[u8]>>, round: u64) -> io::Result<u64> {
        let tls = self.peer_tls().map_err(io::Error::other)?;
        let name = ServerName::from(node.ip());
        let mut peer = Peer::connect(node, tls.map(|c| (c, name)), PEER_TIMEOUT)?;
        if let Some(password) = &self.password {
            peer.auth(password)?;
        }
        let mut later = Vec::new();
        let mut trouble = None;
        let sent = self.hand_batches(&mut peer, keys, &mut later, &mut trouble, round);
        keys.append(&mut later);
        let took = sent?;
        match trouble {
            Some(e) => Err(io::Error::other(e)),
            None => Ok(took),
        }
    }

    /// [`KvService::hand_to`]'s batches, taking each from the front of `keys` once its
    /// replies are read; the keys to try again go to `later`, and what kept the first of
    /// them from being taken to `trouble`.
    fn hand_batches(
        &self,
        peer: &mut Peer,
        keys: &mut Vec<Arc<[u8]>>,
        later: &mut Vec<Arc<[u8]>>,
        trouble: &mut Option<String>,
        round: u64,
    ) -> io::Result<u64> {
        let mut took = 0;
        while !keys.is_empty() {
            // The batch: the keys still held of the first `taken`, with their values.
            let mut batch = Vec::new();
            let (mut taken, mut bytes) = (0, 0);
            for key in keys.iter() {
                if batch.len() == BATCH_KEYS || bytes >= BATCH_BYTES {
                    break;
                }
                taken += 1;
                // Not if gone since: evicted, expired or flushed.
                match self.lock().peek(key) {
                    Some((value, deadline)) => {
                        bytes += value.len() as usize;
                        batch.push((key, value, deadline));
                    }
                    None => self.no_longer_waiting(round),
                }
            }
            let values: Vec<&Extents> = batch.iter().map(|(_, v, _)| &**v).collect();
            let read = match self.read_all(&values) {
                Ok(read) => read,
                Err(e) => {
                    self.counters.storage_errors.fetch_add(1, Relaxed);
                    trouble.get_or_insert_with(|| format!("reading values to hand over: {e}"));
                    later.extend(batch.iter().map(|(key, _, _)| Arc::clone(key)));
                    keys.drain(..taken);
                    continue;
                }
            };
            let mut out = Vec::new();
            let mut sent = Vec::new();
            for ((key, value, deadline), bytes) in batch.into_iter().zip(read) {
                match bytes {
                    Some(bytes) => {
                        set_request(&mut out, key, &bytes, deadline);
                        sent.push((key, value));
                    }
                    // Not what was written: dropped, as a client's read drops it.
                    None => {
                        self.lock().remove_value(key, &value);
                        self.no_longer_waiting(round);
                    }
                }
            }
            // This batch's keys to try again: in `keys` until its replies are read.
            let mut again = Vec::new();
            peer.stream.write_all(&out)?;
            for (key, value) in &sent {
                match peer.answer()? {
                    Answer::Done | Answer::Null => {
                        self.lock().remove_value(key, value);
                        self.counters.handed_off.fetch_add(1, Relaxed);
                        self.no_longer_waiting(round);
                        took += 1;
                    }
                    Answer::Error(e) => {
                        again.push(Arc::clone(key));
                        if !not_yet(&e) {
                            trouble.get_or_insert_with(|| format!("the node refused a key: {e}"));
                        }
                    }
                }
            }
            keys.drain(..taken);
            later.append(&mut again);
        }
        Ok(took)
    }

    /// A key waiting to be handed over by the hand-off `round` is no longer: taken, or
    /// gone. Not counted once another hand-off has begun: it counts the keys waiting
    /// afresh.
    fn no_longer_waiting(&self, round: u64) {
        self.counters.handoffs.one_less(round);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_superseded_hand_off_leaves_the_count_of_the_next_alone() {
        let h = Handoffs::default();
        let first = h.begin();
        h.waiting_for(first, 3);
        h.one_less(first);
        assert_eq!(h.waiting(), 2);
        // A change of the node list: the keys still count until counted afresh.
        let second = h.begin();
        assert_eq!((h.round(), h.waiting()), (second, 2));
        h.waiting_for(second, 5);
        // The first, still finishing, neither counts down nor clears the second's.
        h.one_less(first);
        h.waiting_for(first, 0);
        assert_eq!(h.waiting(), 5);
        h.one_less(second);
        assert_eq!(h.waiting(), 4);
        h.waiting_for(second, 0);
        h.one_less(second);
        assert_eq!(h.waiting(), 0);
    }

    #[test]
    fn a_key_goes_as_a_set_that_keeps_a_newer_value_and_its_deadline() {
        let mut out = Vec::new();
        set_request(&mut out, b"k", b"v\r\n", None);
        assert_eq!(
            out,
            b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$2\r\nNX\r\n"
        );
        out.clear();
        set_request(&mut out, b"k", b"", Some(1_700_000_000_123));
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("*6\r\n$3\r\nSET\r\n$1\r\nk\r\n$0\r\n\r\n$2\r\nNX\r\n"));
        assert!(
            text.ends_with("$4\r\nPXAT\r\n$13\r\n1700000000123\r\n"),
            "{text}"
        );
    }

    #[test]
    fn redirects_and_a_cluster_not_ready_are_tried_again() {
        assert!(not_yet("MOVED 3999 127.0.0.1:7001") && not_yet("CLUSTERDOWN The cluster is down"));
        assert!(!not_yet("OOM no room") && !not_yet("ERR value too large"));
    }
}
