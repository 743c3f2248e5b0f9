//! The announcements an I/O thread sends out of the live ports it opened (see
//! [`crate::ir::Program::announcements`]): every address a port answers for when it opens
//! (again), and after a reload the addresses the new pipeline answers for there that the
//! old one did not, or answered for with another hardware address. Each is sent twice,
//! [`ANNOUNCE_INTERVAL`] apart, as RFC 5227 §2.3 sends them: one frame may be lost.

use super::Shared;
use crate::engine::announcement;
use crate::io::live::LivePort;
use crate::ir::Announcement;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// RFC 5227 §1.1's ANNOUNCE_INTERVAL.
const ANNOUNCE_INTERVAL: Duration = Duration::from_secs(2);

/// One I/O thread's announcements.
pub(super) struct Announcer {
    /// The pipeline generation `lists` are of.
    generation: u64,
    /// What each port (by index) answers for.
    lists: Vec<Vec<Announcement>>,
    /// Per port: what to announce a second time, and when.
    again: Vec<Option<(Instant, Vec<Announcement>)>>,
}

impl Announcer {
    /// For the pipeline published now.
    pub(super) fn new(shared: &Shared) -> Announcer {
        let loaded = shared.loaded();
        let lists = loaded.program.announcements();
        Announcer {
            generation: loaded.generation,
            again: vec![None; lists.len()],
            lists,
        }
    }

    /// Port `i` opened, or opened again: announces all it answers for.
    pub(super) fn opened(&mut self, port: &mut LivePort, i: usize) {
        let list = self.lists.get(i).cloned().unwrap_or_default();
        self.announce(
            port,
            i,
            list,
            "announced the addresses the pipeline answers for",
        );
    }

    /// Takes a reload's pipeline, if there is one: announces out of each open port what
    /// it answers for there anew.
    pub(super) fn reloaded(&mut self, live: &mut [Option<LivePort>], shared: &Shared) {
        if shared.generation.load(Ordering::Relaxed) == self.generation {
            return;
        }
        let loaded = shared.loaded();
        let lists = loaded.program.announcements();
        for (i, slot) in live.iter_mut().enumerate() {
            let (Some(port), Some(new)) = (slot, lists.get(i)) else {
                continue;
            };
            let old = self.lists.get(i).map_or(&[][..], Vec::as_slice);
            let fresh: Vec<_> = new.iter().filter(|a| !old.contains(a)).copied().collect();
            self.announce(
                port,
                i,
                fresh,
                "announced what the reloaded pipeline answers for anew",
            );
        }
        (self.generation, self.lists) = (loaded.generation, lists);
    }

    /// Sends port `i`'s second round, if it is due.
    pub(super) fn due(&mut self, port: &mut LivePort, i: usize) {
        let Some(again) = self.again.get_mut(i) else {
            return;
        };
        if again.as_ref().is_some_and(|(at, _)| *at <= Instant::now()) {
            if let Some((_, list)) = again.take() {
                send(port, &list, "announced again");
            }
        }
    }

    /// Sends `list` out of port `i` and notes it for the second round (with what is
    /// already waiting for it): by the thread whose socket started the port's group when
    /// the workers share it.
    fn announce(&mut self, port: &mut LivePort, i: usize, list: Vec<Announcement>, what: &str) {
        if list.is_empty() || !port.group().is_none_or(|joined| joined.started) {
            return;
        }
        send(port, &list, what);
        let Some(again) = self.again.get_mut(i) else {
            return;
        };
        let mut waiting = again.take().map(|(_, l)| l).unwrap_or_default();
        for a in list {
            if !waiting.contains(&a) {
                waiting.push(a);
            }
        }
        *again = Some((Instant::now() + ANNOUNCE_INTERVAL, waiting));
    }
}

fn send(port: &mut LivePort, list: &[Announcement], what: &str) {
    let sent = list
        .iter()
        .filter(|a| port.send(&announcement(a)).is_ok())
        .count();
    let dropped = port.flush().dropped;
    tracing::info!(
        iface = port.iface(),
        addresses = list.len(),
        sent = sent.saturating_sub(dropped),
        "{what}"
    );
}
