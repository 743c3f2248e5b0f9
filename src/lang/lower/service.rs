//! Lowering of `service` blocks: the KV-cache service's settings and storage targets.

use super::{opt_value, Lowerer};
use crate::ir::*;
use crate::lang::ast::{self, Word};
use crate::lang::diag::{did_you_mean, Span};
use crate::lang::value;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Values a KV-cache service keeps in memory by default: a connector's metadata beside
/// its chunks, and small values generally, are served without a round trip to the
/// target. At most a 256th of a store of 64 KiB blocks, were every value that small.
const DEFAULT_INLINE_MAX: u64 = 256;
/// A service's stripe over several targets unless it says otherwise (rounded up to whole
/// blocks): a value of up to a few MiB, as KV-cache connectors write them, mostly on one
/// target, in one request there; values of different requests on different targets.
const DEFAULT_STRIPE: u64 = 1 << 20;
/// The most blocks a stripe may have: the superblock keeps the count in 16 bits.
const MAX_STRIPE_BLOCKS: u64 = u16::MAX as u64;
/// The most `inline_max` may be: memory for a value in every block.
const MAX_INLINE_MAX: u64 = 64 << 10;

/// How often a KV-cache service saves its index by default (Redis's default `save` points
/// save within a minute of many writes): a crash loses at most about this much.
const DEFAULT_CHECKPOINT: Duration = Duration::from_secs(60);
/// The shortest checkpoint interval: each one may write the whole index.
const MIN_CHECKPOINT: Duration = Duration::from_secs(1);

/// The most clients a service may serve at once: each is a thread of its own, and a
/// thread takes two memory mappings (its stack and the guard page below), of the 65530 a
/// process has by default (`vm.max_map_count`).
const MAX_MAX_CLIENTS: u64 = 16384;

/// How long a network target may keep a request waiting by default: Linux's NVMe
/// `io_timeout` (`nvme_core.io_timeout`).
const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(30);
/// The shortest `io_timeout`: a target on a busy network answers a round trip late now
/// and then, and each timeout makes a connection afresh.
const MIN_IO_TIMEOUT: Duration = Duration::from_millis(100);

/// A storage target as a service's `target` names it.
fn parse_storage_target(text: &str) -> Option<StorageTarget> {
    let (scheme, rest) = text.split_once("://")?;
    match scheme {
        "nvme-tcp" => {
            let (addr, nqn) = rest.split_once('/')?;
            (!nqn.is_empty()).then_some(())?;
            Some(StorageTarget::NvmeTcp {
                addr: addr.parse().ok()?,
                nqn: nqn.to_owned(),
            })
        }
        "nbd" => {
            let (addr, export) = rest.split_once('/').unwrap_or((rest, ""));
            Some(StorageTarget::Nbd {
                addr: addr.parse().ok()?,
                export: export.to_owned(),
            })
        }
        "nvme" | "file" => rest.starts_with('/').then(|| StorageTarget::Local {
            path: PathBuf::from(rest),
        }),
        _ => None,
    }
}

/// Where a service block names `target` (the block's name when it does not).
pub(super) fn target_span(b: &ast::NamedBlock, target: &StorageTarget) -> Span {
    b.options
        .iter()
        .filter(|o| o.key.text == "target")
        .find(|o| parse_storage_target(o.values[0].as_str()).as_ref() == Some(target))
        .map_or(b.name.span, |o| o.values[0].span)
}

impl Lowerer<'_> {
    pub(super) fn service(&mut self, b: &ast::NamedBlock) -> Option<Service> {
        self.check_repeats(&b.options, &["target", "cluster_node"]);
        let kind = match opt_value(&b.options, "type") {
            Some(o) => self.single(o)?.text.to_string(),
            None => b.name.text.to_string(),
        };
        if kind != "kvcache" {
            let at = opt_value(&b.options, "type").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, format!("unknown service type `{kind}`")).hint = Some(
                did_you_mean(&kind, ["kvcache"])
                    .unwrap_or_else(|| "the service types are: kvcache".into()),
            );
            return None;
        }
        let mut listen = None;
        let mut targets: Vec<StorageTarget> = Vec::new();
        let mut capacity = None;
        let mut block_size = 65536;
        let mut stripe = None;
        let mut connections = 8;
        let mut inline_max = DEFAULT_INLINE_MAX;
        let mut checkpoint = Some(DEFAULT_CHECKPOINT);
        let mut nvme_digests = NvmeDigests::default();
        let mut page_cache = None;
        let mut discard = false;
        let mut leaving = false;
        let mut io_timeout = DEFAULT_IO_TIMEOUT;
        let mut max_clients = DEFAULT_MAX_CLIENTS;
        let mut slowlog = Some(DEFAULT_SLOWLOG);
        let mut password_file = None;
        let mut cluster: Vec<(SocketAddr, Span)> = Vec::new();
        let (mut tls_cert, mut tls_key, mut tls_client_ca) = (None, None, None);
        let mut ok = true;
        for o in &b.options {
            let (text, span) = self.joined(o);
            let w = &Word {
                text: text.into(),
                span,
                quoted: o.values[0].quoted,
            };
            match o.key.as_str() {
                "type" => {}
                "listen" => {
                    listen = self.parsed(
                        w,
                        "listen address",
                        "write IP:PORT, e.g. 127.0.0.1:6379",
                        value::socket_addr,
                    )
                }
                "target" => match self.storage_target(w) {
                    Some(t) if targets.contains(&t) => {
                        self.err(w.span, format!("target `{}` is given twice", w.text))
                            .add_note(target_span(b, &t), "first given here")
                            .hint = Some("list each target once: the store is striped over them in the order given".into());
                        ok = false;
                    }
                    Some(t) => targets.push(t),
                    None => ok = false,
                },
                "capacity" => {
                    capacity =
                        self.parsed(w, "capacity", "write a size such as `64GiB`", value::size)
                }
                "block_size" => match self.parsed_if(
                    w,
                    ("block size", "write a size such as `64KiB`"),
                    value::size,
                    |s| s >= 512 && s % 512 == 0,
                    |s| format!("block size {s} is not a multiple of 512 bytes"),
                ) {
                    Some(s) => block_size = s,
                    None => ok = false,
                },
                "stripe" => match self.parsed(
                    w,
                    "stripe size",
                    "write a size such as `1MiB`",
                    value::size,
                ) {
                    Some(n) => stripe = Some((n, w.span)),
                    None => ok = false,
                },
                "max_clients" => match self.parsed_if(
                    w,
                    ("client count", "write a count from 1 to 16384"),
                    value::count,
                    |n| (1..=MAX_MAX_CLIENTS).contains(&n),
                    |n| format!("`max_clients` is 1 to {MAX_MAX_CLIENTS}, not {n}"),
                ) {
                    Some(n) => max_clients = n,
                    None => ok = false,
                },
                "slowlog" if w.as_str() == "off" => slowlog = None,
                "slowlog" => match self.parsed(
                    w,
                    "slow log threshold",
                    "write a duration such as `10ms`, or `off` to keep no slow log",
                    value::duration,
                ) {
                    Some(d) => slowlog = Some(d),
                    None => ok = false,
                },
                "connections" => match self.parsed_if(
                    w,
                    ("connection count", "write a count from 1 to 256"),
                    value::count,
                    |n| (1..=256).contains(&n),
                    |n| format!("`connections` is 1 to 256, not {n}"),
                ) {
                    Some(n) => connections = n as usize,
                    None => ok = false,
                },
                "inline_max" => match self.parsed_if(
                    w,
                    (
                        "inline size",
                        "write a size such as `256B`, or 0 to keep every value on the target",
                    ),
                    value::size,
                    |n| n <= MAX_INLINE_MAX,
                    |n| format!("`inline_max` is at most {MAX_INLINE_MAX} bytes, not {n}"),
                ) {
                    Some(n) => inline_max = n,
                    None => ok = false,
                },
                "checkpoint" if w.as_str() == "off" => checkpoint = None,
                "checkpoint" => match self.parsed_if(
                    w,
                    (
                        "checkpoint interval",
                        "write a duration such as `30s`, or `off` to save the index only at a clean stop",
                    ),
                    value::duration,
                    |d| d >= MIN_CHECKPOINT,
                    |d| {
                        format!(
                            "`checkpoint` is at least {}s (each one may write the whole index), not {}ms",
                            MIN_CHECKPOINT.as_secs(),
                            d.as_millis()
                        )
                    },
                ) {
                    Some(d) => checkpoint = Some(d),
                    None => ok = false,
                },
                "nvme_digest" => {
                    let (header, data) = match w.as_str() {
                        "none" => (false, false),
                        "header" => (true, false),
                        "data" => (false, true),
                        "both" => (true, true),
                        other => {
                            self.err(
                                w.span,
                                format!(
                                    "`nvme_digest` is none, header, data or both, not `{other}`"
                                ),
                            );
                            ok = false;
                            (false, false)
                        }
                    };
                    nvme_digests = NvmeDigests { header, data };
                }
                "page_cache" => match self.on_off(o, "reads and writes a local target through the kernel's page cache") {
                    Some(on) => page_cache = Some(on),
                    None => ok = false,
                },
                "discard" => match self.on_off(o, "tells the target which blocks no longer hold data") {
                    Some(on) => discard = on,
                    None => ok = false,
                },
                "cluster_leaving" => match self.on_off(o, "takes this node out of the cluster, its keys handed to the nodes listed") {
                    Some(on) => leaving = on,
                    None => ok = false,
                },
                "io_timeout" => match self.parsed_if(
                    w,
                    ("I/O timeout", "write a duration such as `30s`"),
                    value::duration,
                    |d| d >= MIN_IO_TIMEOUT,
                    |d| {
                        format!(
                            "`io_timeout` is at least {}ms, not {}ms",
                            MIN_IO_TIMEOUT.as_millis(),
                            d.as_millis()
                        )
                    },
                ) {
                    Some(d) => io_timeout = d,
                    None => ok = false,
                },
                "cluster_node" => match self.parsed(
                    w,
                    "cluster node address",
                    "write the IP:PORT hosts reach that node's service at, e.g. 10.0.0.2:6379",
                    value::socket_addr,
                ) {
                    Some(a) => match cluster.iter().find(|(b, _)| *b == a) {
                        Some(&(_, first)) => {
                            self.err(w.span, format!("cluster node `{a}` is given twice"))
                                .add_note(first, "first given here")
                                .hint = Some(
                                "list each node once, in the same order on every node".into(),
                            );
                            ok = false;
                        }
                        None => cluster.push((a, w.span)),
                    },
                    None => ok = false,
                },
                "password_file" => password_file = Some(PathBuf::from(w.as_str())),
                "tls_cert" => tls_cert = Some(PathBuf::from(w.as_str())),
                "tls_key" => tls_key = Some(PathBuf::from(w.as_str())),
                "tls_client_ca" => tls_client_ca = Some(PathBuf::from(w.as_str())),
                _ => unreachable!("the parser accepts only service keys"),
            }
        }
        let missing = |l: &mut Self, what: &str, example: &str| {
            l.err(
                b.name.span,
                format!("service `{}` has no `{what}`", b.name.text),
            )
            .hint = Some(format!("add `{what} {example}`"));
        };
        if opt_value(&b.options, "listen").is_none() {
            missing(self, "listen", "127.0.0.1:6379");
        }
        if opt_value(&b.options, "target").is_none() {
            missing(
                self,
                "target",
                "\"nvme-tcp://127.0.0.1:4420/nqn.2014-08.org.example:kv\"",
            );
        }
        if opt_value(&b.options, "capacity").is_none() {
            missing(self, "capacity", "64GiB");
        }
        let owner = format!("service `{}`", b.name.text);
        let tls = self.tls_files(tls_cert, tls_key, tls_client_ca, b.name.span, &owner);
        ok &= tls.is_ok();
        let tls = tls.unwrap_or_default();
        let stripe = match stripe {
            None => DEFAULT_STRIPE.div_ceil(block_size) * block_size,
            Some((n, at)) => {
                if n == 0 || n % block_size != 0 || n / block_size > MAX_STRIPE_BLOCKS {
                    self.err(
                        at,
                        format!(
                            "`stripe` is a whole number of blocks ({block_size} bytes each), from one to {MAX_STRIPE_BLOCKS}, not {n} bytes"
                        ),
                    )
                    .hint = Some(format!(
                        "a multiple of `block_size`, such as {}",
                        DEFAULT_STRIPE.div_ceil(block_size) * block_size
                    ));
                    ok = false;
                }
                n
            }
        };
        let (listen, capacity) = (listen?, capacity?);
        if targets.is_empty() {
            return None;
        }
        if nvme_digests != NvmeDigests::default()
            && !targets
                .iter()
                .all(|t| matches!(t, StorageTarget::NvmeTcp { .. }))
        {
            let at = opt_value(&b.options, "nvme_digest").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, "`nvme_digest` applies to nvme-tcp:// targets only")
                .hint = Some("NBD and local targets have no digests; remove the option".into());
            ok = false;
        }
        if page_cache.is_some()
            && !targets
                .iter()
                .all(|t| matches!(t, StorageTarget::Local { .. }))
        {
            let at = opt_value(&b.options, "page_cache").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, "`page_cache` applies to local targets only")
                .hint = Some(
                "nvme-tcp:// and nbd:// targets are reached over the network; remove the option"
                    .into(),
            );
            ok = false;
        }
        if opt_value(&b.options, "io_timeout").is_some()
            && targets
                .iter()
                .all(|t| matches!(t, StorageTarget::Local { .. }))
        {
            let at = opt_value(&b.options, "io_timeout").map_or(b.name.span, |o| o.values[0].span);
            self.err(
                at,
                "`io_timeout` applies to nvme-tcp:// and nbd:// targets only",
            )
            .hint = Some(
                "a local target's reads and writes are the kernel's to time out; remove the option"
                    .into(),
            );
            ok = false;
        }
        let listed = cluster.iter().any(|(a, _)| *a == listen);
        let leaving_at =
            opt_value(&b.options, "cluster_leaving").map_or(b.name.span, |o| o.values[0].span);
        if leaving && cluster.is_empty() {
            self.err(
                leaving_at,
                "a node leaving a cluster needs the `cluster_node`s it hands its keys to",
            )
            .hint = Some("list the nodes that stay, as they list themselves".into());
            ok = false;
        } else if leaving && listed {
            let at = opt_value(&b.options, "listen").map_or(b.name.span, |o| o.values[0].span);
            self.err(
                at,
                format!(
                    "`listen` {listen} is among the `cluster_node`s of a node leaving the cluster"
                ),
            )
            .add_note(leaving_at, "leaving from here")
            .hint = Some("list the nodes that stay, without this one".into());
            ok = false;
        } else if !leaving && !cluster.is_empty() && !listed {
            let at = opt_value(&b.options, "listen").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, format!("`listen` {listen} is not among the `cluster_node`s"))
                .add_note(cluster[0].1, "the cluster's nodes are listed from here")
                .hint = Some("list this node too, by the address it listens on and hosts reach it at: every node lists the same nodes in the same order (or, to take it out of the cluster and hand its keys to the nodes listed, add `cluster_leaving on`)".into());
            ok = false;
        }
        ok.then(|| Service {
            name: b.name.text.to_string(),
            kind: ServiceKind::KvCache(KvCache {
                listen,
                targets,
                capacity,
                block_size,
                stripe,
                connections,
                inline_max: inline_max.min(block_size),
                checkpoint,
                nvme_digests,
                page_cache,
                discard,
                io_timeout,
                max_clients,
                slowlog,
                password_file,
                tls,
                cluster: cluster.into_iter().map(|(a, _)| a).collect(),
                cluster_leaving: leaving,
            }),
        })
    }

    fn storage_target(&mut self, w: &Word) -> Option<StorageTarget> {
        let parsed = parse_storage_target(&w.text);
        if parsed.is_none() {
            self.err(w.span, format!("invalid storage target `{}`", w.text))
                .hint = Some("targets are nvme-tcp://HOST:PORT/NQN, nbd://HOST:PORT[/EXPORT], nvme:///dev/DEVICE and file:///PATH".into());
        }
        parsed
    }
}
