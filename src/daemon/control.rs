//! The control thread: reloads on SIGHUP, the dataplane's health judged, and what a
//! service manager is told (sd_notify(3)).

use super::liveness::Liveness;
use super::notify::{self, Notifier};
use super::reload::{self, Loaded, PipelineFile, ReloadError};
use super::{Shared, Stalled};
use crate::ir::Driver;
use crate::telemetry::http::Handler;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

impl Shared {
    /// A line on how the service stands, for `systemctl status`.
    fn status(&self) -> String {
        if let Some(s) = &*self.stalled.lock().unwrap_or_else(|e| e.into_inner()) {
            return format!("dataplane stalled: {}", s.threads);
        }
        if self.dataplane_done.load(Ordering::Relaxed) {
            return "the inputs are done; serving metrics".to_owned();
        }
        let loaded = self.loaded();
        let mut s = format!(
            "running pipeline {} (generation {}) on {} worker{}",
            loaded.program.name,
            loaded.generation,
            self.workers,
            if self.workers == 1 { "" } else { "s" }
        );
        if self.ports_waiting.load(Ordering::Relaxed) > 0 {
            // The live ports not open: those awaited (at the start, or since their
            // interface went).
            let waiting: Vec<&str> = (loaded.program.ports.iter().enumerate())
                .filter(|&(i, p)| {
                    matches!(p.driver, Driver::AfPacket | Driver::AfXdp)
                        && !self.port_open[i].load(Ordering::Relaxed)
                })
                .filter_map(|(_, p)| p.iface.as_deref())
                .collect();
            s.push_str(&format!("; waiting for interface {}", waiting.join(", ")));
        }
        if self.reloads.last_failed.load(Ordering::Relaxed) {
            s.push_str("; the last reload was refused (see the log)");
        }
        s
    }
}

/// The control thread, until `stop`: judges whether the dataplane's threads go on
/// ([`liveness`](super::liveness)), keeps the service manager told ([`Told`]), and reloads: on each
/// SIGHUP (`hup` set), once every worker runs the pipeline of the reload before, loads
/// `file` again and publishes it, or logs why not and keeps the running one; and reads the
/// listeners' TLS files and the metrics endpoint's users again at once.
pub(super) fn control(file: &PipelineFile, hup: &AtomicBool, stop: &AtomicBool, shared: &Shared) {
    // The reload published and not yet taken by every worker, and when it was published.
    let mut pending = None::<(u64, Instant)>;
    // The reload being read, checked and compiled, in a thread of its own so that this
    // one goes on judging the dataplane and feeding the watchdog meanwhile (a
    // million-entry table takes seconds), with the pipeline it follows.
    let mut loading = None::<(JoinHandle<Result<Loaded, ReloadError>>, Arc<Loaded>)>;
    let mut liveness = Liveness::new(shared.workers + 1, Instant::now());
    let mut told = Told::new(shared.notifier.as_ref());
    // The TLS and users' files were read again for the SIGHUP being handled (a reload may wait for
    // the workers to take the one before).
    let mut credentials_reread = false;
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(reload::POLL);
        judge(shared, &mut liveness);
        told.update(shared);
        if let Some((generation, at)) = pending.filter(|&(g, _)| shared.workers_run(g)) {
            // No worker runs the previous program now: what it held is free.
            crate::sys::release_free_memory();
            let longest = shared.reloads.longest_swap_ns.swap(0, Ordering::Relaxed);
            tracing::info!(
                generation,
                seconds = at.elapsed().as_secs_f64(),
                longest_pause_seconds = longest as f64 * 1e-9,
                "every worker runs the reloaded pipeline"
            );
            pending = None;
        }
        if let Some((thread, current)) = loading.take() {
            if !thread.is_finished() {
                loading = Some((thread, current));
                continue;
            }
            // A panic there is the service's, as it was when reloads ran here.
            let next = thread
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            if let Some(generation) = take_reload(next, &current, file, shared) {
                pending = Some((generation, Instant::now()));
            }
            // Ready again, said with the status the reload left.
            told.ready = false;
            told.update(shared);
            continue;
        }
        if !hup.load(Ordering::Relaxed) {
            continue;
        }
        if !credentials_reread {
            shared.reread_credentials();
            credentials_reread = true;
        }
        let current = shared.loaded();
        if !shared.workers_run(current.generation) {
            continue;
        }
        hup.store(false, Ordering::Relaxed);
        credentials_reread = false;
        told.send("RELOADING=1");
        let (to_load, from, workers) = (file.clone(), Arc::clone(&current), shared.workers);
        let thread = std::thread::Builder::new()
            .name("reload".to_owned())
            .spawn(move || reload::load_next(&to_load, &from, workers));
        match thread {
            Ok(thread) => loading = Some((thread, current)),
            Err(e) => {
                take_reload(Err(ReloadError::Thread(e)), &current, file, shared);
                told.ready = false;
                told.update(shared);
            }
        }
    }
}

/// Publishes the pipeline a reload made from `current` for the workers to take (after
/// steering the kernel's fanout by its tunnel ports, where it steers), or logs why it
/// was refused; counts either. The generation published, if one was.
fn take_reload(
    next: Result<Loaded, ReloadError>,
    current: &Loaded,
    file: &PipelineFile,
    shared: &Shared,
) -> Option<u64> {
    let counts = &shared.reloads;
    let next = next.and_then(|next| {
        shared.steer_for(current, &next).map_err(|e| {
            ReloadError::Steering(format!(
                "the kernel refused the program that steers the new tunnel ports' \
                 connections to their workers: {e}"
            ))
        })?;
        Ok(next)
    });
    match next {
        Ok(next) => {
            // A KV-cache service's new cluster node list applies at once.
            for (name, nodes, leaving) in reload::regrouped(&current.program, &next.program) {
                if let Some(kv) = shared.kv.iter().find(|kv| kv.name == name) {
                    kv.regroup(nodes, leaving);
                }
            }
            let (generation, seconds) = (next.generation, next.seconds);
            let (pipes, entries) = (next.program.pipes.len(), next.program.entry_count());
            *shared.loaded.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(next);
            shared.generation.store(generation, Ordering::Release);
            counts.succeeded.fetch_add(1, Ordering::Relaxed);
            counts.last_failed.store(false, Ordering::Relaxed);
            tracing::info!(
                path = %file.path.display(),
                generation,
                pipes,
                entries,
                seconds,
                "pipeline reloaded"
            );
            Some(generation)
        }
        Err(e) => {
            counts.failed.fetch_add(1, Ordering::Relaxed);
            counts.last_failed.store(true, Ordering::Relaxed);
            tracing::error!(path = %file.path.display(), "reload refused, the running pipeline kept: {e}");
            None
        }
    }
}

/// Notes which dataplane threads are stalled (see [`liveness`](super::liveness)), for `/healthz` and the
/// watchdog, and logs when that changes. The threads are judged while they all run:
/// not while the workers start, nor once the inputs are done.
pub(super) fn judge(shared: &Shared, liveness: &mut Liveness) {
    let now = Instant::now();
    let running = shared.workers_up.load(Ordering::Relaxed) == shared.workers
        && !shared.dataplane_done.load(Ordering::Relaxed);
    let stalled = if running {
        // Where each worker reads its own share, there is no I/O thread: its slot is
        // shared by the workers' reading, and each worker's own slot tells.
        let judged = |slot| slot < shared.workers || shared.groups.is_none();
        liveness.observe(shared.beats.counts(), judged, now)
    } else {
        liveness.restart(now);
        Vec::new()
    };
    let name = |slot| super::thread_name(shared.workers, slot);
    let said = (!stalled.is_empty()).then(|| {
        let threads: Vec<_> = stalled.iter().map(|&(slot, _)| name(slot)).collect();
        let detail: Vec<_> = stalled
            .iter()
            .map(|&(slot, stood)| {
                format!(
                    "{} (no progress for {:.1} s)",
                    name(slot),
                    stood.as_secs_f64()
                )
            })
            .collect();
        Stalled {
            count: threads.len(),
            threads: threads.join(", "),
            detail: format!("dataplane stalled: {}", detail.join(", ")),
        }
    });
    let mut now_said = shared.stalled.lock().unwrap_or_else(|e| e.into_inner());
    match (&*now_said, &said) {
        (None, Some(s)) => tracing::error!(
            "{}; /healthz fails and a service manager's watchdog is no longer fed",
            s.detail
        ),
        (Some(_), None) => tracing::info!("the dataplane goes on again"),
        _ => {}
    }
    *now_said = said;
}

/// What the service manager has been told, and what it is told next (see [`notify`]):
/// `READY=1` once every worker runs (ports whose interfaces are awaited are awaited
/// then, said in the status), the status line as it changes, `WATCHDOG=1` as often as
/// the manager asked while no dataplane thread is stalled.
struct Told<'n> {
    notifier: Option<&'n Notifier>,
    ready: bool,
    status: String,
    fed: Option<Instant>,
    /// A failed send has been logged (it is logged once).
    failed: bool,
}

impl<'n> Told<'n> {
    fn new(notifier: Option<&'n Notifier>) -> Told<'n> {
        Told {
            notifier,
            ready: false,
            status: String::new(),
            fed: None,
            failed: false,
        }
    }

    fn update(&mut self, shared: &Shared) {
        let Some(notifier) = self.notifier else {
            return;
        };
        if shared.workers_up.load(Ordering::Relaxed) < shared.workers {
            return;
        }
        let mut lines = Vec::new();
        if !self.ready {
            self.ready = true;
            lines.push("READY=1".to_owned());
        }
        let status = shared.status();
        if status != self.status {
            lines.push(notify::status(&status));
            self.status = status;
        }
        let healthy = shared.unhealthy().is_none();
        if let Some(every) = notifier.watchdog().filter(|_| healthy) {
            if self.fed.is_none_or(|at| at.elapsed() >= every) {
                self.fed = Some(Instant::now());
                lines.push("WATCHDOG=1".to_owned());
            }
        }
        if !lines.is_empty() {
            self.send(&lines.join("\n"));
        }
    }

    fn send(&mut self, state: &str) {
        let Some(notifier) = self.notifier else {
            return;
        };
        if let Err(e) = notifier.send(state) {
            if !std::mem::replace(&mut self.failed, true) {
                tracing::warn!(error = %e, "cannot tell the service manager how the service stands");
            }
        }
    }
}
