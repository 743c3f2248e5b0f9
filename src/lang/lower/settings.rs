//! Lowering of the settings blocks beside the pipes: ports, meters, connection tracking
//! and telemetry.

use super::{opt_value, Lowerer, MIN_IPFIX_MTU};
use crate::ir::*;
use crate::lang::ast;
use crate::lang::diag::did_you_mean;
use crate::lang::value;
use std::path::PathBuf;

/// Most connections one worker's table may hold: it is allocated and written at start,
/// about 120 bytes a connection (30 GiB at this bound).
const MAX_CT_CAPACITY: u64 = 1 << 28;
/// Most flows one worker's IPFIX flow cache may hold (its vectors are reserved up front:
/// about 6.7 GB of address space at this bound).
const MAX_FLOW_CACHE: u64 = 1 << 26;
/// Connections tracked when the `conntrack` block does not say.
pub(super) const DEFAULT_CT_CAPACITY: u64 = 1 << 20;

impl Lowerer<'_> {
    pub(super) fn port(&mut self, b: &ast::NamedBlock) -> Option<Port> {
        // An address of each IP version.
        self.check_repeats(&b.options, &["address"]);
        let mut port = Port {
            name: b.name.text.to_string(),
            driver: Driver::Pcap,
            iface: None,
            file: None,
            out: None,
            queues: 1,
            mtu: 1500,
            ipv4: None,
            ipv6: None,
        };
        let mut driver = None;
        let mut ok = true;
        for o in &b.options {
            let Some(w) = self.single(o) else {
                ok = false;
                continue;
            };
            match o.key.as_str() {
                "driver" => match Driver::ALL.iter().find(|(n, _)| *n == w.text) {
                    Some(&(_, d)) => driver = Some(d),
                    None => {
                        let hint = did_you_mean(&w.text, Driver::ALL.iter().map(|(n, _)| *n))
                            .unwrap_or_else(|| {
                                "drivers are pcap, af_packet, af_xdp and doca".into()
                            });
                        self.err(w.span, format!("unknown driver `{}`", w.text))
                            .hint = Some(hint);
                        ok = false;
                    }
                },
                "iface" => port.iface = Some(w.text.to_string()),
                "file" => port.file = Some(PathBuf::from(w.as_str())),
                "out" => port.out = Some(PathBuf::from(w.as_str())),
                "queues" => match self.int_in(w, "queue count", 1, 1024) {
                    Some(q) => port.queues = q as u16,
                    None => ok = false,
                },
                "mtu" => match self.int_in(w, "MTU", 68, 65535) {
                    Some(m) => port.mtu = m as u16,
                    None => ok = false,
                },
                "address" => {
                    let (v4, v6) = (value::ipv4(&w.text), value::ipv6(&w.text));
                    let taken = match (v4, v6) {
                        (Some(a), _) => port.ipv4.replace(a).is_some(),
                        (_, Some(a)) => port.ipv6.replace(a).is_some(),
                        (None, None) => {
                            self.err(w.span, format!("invalid address `{}`", w.text))
                                .hint = Some("an IPv4 or IPv6 address: `address 192.0.2.1`".into());
                            ok = false;
                            continue;
                        }
                    };
                    let one_host = match (v4, v6) {
                        (Some(a), _) => {
                            !(a.is_unspecified() || a.is_multicast() || a.is_broadcast())
                        }
                        (_, Some(a)) => !(a.is_unspecified() || a.is_multicast()),
                        _ => true,
                    };
                    if taken {
                        self.err(w.span, "the port has an address of this IP version already")
                            .hint = Some("give one IPv4 and one IPv6 address at most".into());
                        ok = false;
                    } else if !one_host {
                        self.err(w.span, format!("`{}` is not one host's address", w.text));
                        ok = false;
                    }
                }
                _ => unreachable!("the parser accepts only port keys"),
            }
        }
        match driver {
            Some(d) => port.driver = d,
            None if !ok => return None,
            None => {
                self.err(b.name.span, format!("port `{}` has no driver", b.name.text))
                    .hint = Some(
                    "add `driver pcap`, `driver af_packet`, `driver af_xdp` or `driver doca`"
                        .into(),
                );
                return None;
            }
        }
        if port.mtu > port.driver.largest_mtu() {
            let at = b
                .options
                .iter()
                .find(|o| o.key.text == "mtu")
                .map_or(b.name.span, |o| o.key.span);
            self.err(
                at,
                format!(
                    "port `{}` uses driver {}, whose MTU is at most {}",
                    b.name.text,
                    port.driver.name(),
                    port.driver.largest_mtu()
                ),
            )
            .hint = Some(
                "AF_XDP puts a frame in one 4 KiB chunk; use driver af_packet for larger frames"
                    .into(),
            );
            ok = false;
        }
        if matches!(port.driver, Driver::AfPacket | Driver::AfXdp | Driver::Doca)
            && port.iface.is_none()
        {
            self.err(
                b.name.span,
                format!(
                    "port `{}` uses driver {} but names no interface",
                    b.name.text,
                    port.driver.name()
                ),
            )
            .hint = Some("add `iface \"NAME\"`".into());
            ok = false;
        }
        ok.then_some(port)
    }

    pub(super) fn meter(&mut self, b: &ast::NamedBlock) -> Option<Meter> {
        self.check_repeats(&b.options, &[]);
        let rate_of = |l: &mut Self, key: &str| -> Option<Option<value::Rate>> {
            let Some(o) = opt_value(&b.options, key) else {
                return Some(None);
            };
            let (text, span) = l.joined(o);
            match value::rate(&text) {
                Some(value::Rate::Pps(0) | value::Rate::Bps(0)) => {
                    l.err(span, format!("`{key}` must be above zero"));
                    None
                }
                Some(r) => Some(Some(r)),
                None => {
                    l.err(span, format!("invalid rate `{text}`")).hint =
                        Some("write packets per second (`10000 pps`, `2 mpps`) or bits per second (`100 mbps`, `10 gbit/s`)".into());
                    None
                }
            }
        };
        let cir = rate_of(self, "rate")?;
        let pir = rate_of(self, "peak")?;
        let Some(cir) = cir else {
            self.err(b.name.span, format!("meter `{}` has no rate", b.name.text))
                .hint = Some("add `rate 10000 pps` or `rate 100 mbps`".into());
            return None;
        };
        let (unit, cir) = match cir {
            value::Rate::Pps(r) => (MeterRate::Packets, r),
            value::Rate::Bps(r) => (MeterRate::Bits, r),
        };
        let burst_of = |l: &mut Self, key: &str| -> Option<Option<u64>> {
            let Some(o) = opt_value(&b.options, key) else {
                return Some(None);
            };
            let (text, span) = l.joined(o);
            let v = match unit {
                MeterRate::Packets => value::count(&text),
                MeterRate::Bits => value::size(&text),
            };
            if v.is_none() {
                let what = if unit == MeterRate::Packets {
                    "packets (`1000`)"
                } else {
                    "bytes (`64KiB`, `1500 bytes`)"
                };
                l.err(span, format!("invalid {key} `{text}`")).hint =
                    Some(format!("this meter's bursts are in {what}"));
            }
            v.map(Some)
        };
        let cbs = burst_of(self, "burst")?;
        let ebs = burst_of(self, "excess_burst")?;
        let pbs = burst_of(self, "peak_burst")?;
        // A burst of one second at the committed rate (bytes for bit rates) when not given.
        let default_burst = match unit {
            MeterRate::Packets => cir,
            MeterRate::Bits => cir / 8,
        };
        let cbs = cbs.unwrap_or(default_burst);
        let algorithm = match pir {
            None => {
                if let Some(o) = opt_value(&b.options, "peak_burst") {
                    self.err(o.key.span, "`peak_burst` without `peak`").hint =
                        Some("add `peak RATE` for a two-rate meter (RFC 2698)".into());
                    return None;
                }
                MeterAlgorithm::SingleRate {
                    ebs: ebs.unwrap_or(cbs),
                }
            }
            Some(p) => {
                let pir = match (unit, p) {
                    (MeterRate::Packets, value::Rate::Pps(r))
                    | (MeterRate::Bits, value::Rate::Bps(r)) => r,
                    _ => {
                        let o =
                            opt_value(&b.options, "peak").map_or(b.name.span, |o| o.values[0].span);
                        self.err(
                            o,
                            "`peak` and `rate` must both be packet rates or both bit rates",
                        );
                        return None;
                    }
                };
                if let Some(o) = opt_value(&b.options, "excess_burst") {
                    self.err(o.key.span, "`excess_burst` belongs to single-rate meters")
                        .hint = Some("a two-rate meter (with `peak`) takes `peak_burst`".into());
                    return None;
                }
                if pir < cir {
                    let o = opt_value(&b.options, "peak").map_or(b.name.span, |o| o.values[0].span);
                    self.err(
                        o,
                        format!("peak rate {pir} is below the committed rate {cir}"),
                    )
                    .hint = Some("RFC 2698 requires PIR >= CIR".into());
                    return None;
                }
                MeterAlgorithm::TwoRate {
                    pir,
                    pbs: pbs.unwrap_or(cbs),
                }
            }
        };
        Some(Meter {
            name: b.name.text.to_string(),
            unit,
            cir,
            cbs,
            algorithm,
        })
    }

    pub(super) fn conntrack(&mut self, s: &ast::Settings) -> Option<Conntrack> {
        self.check_repeats(&s.options, &["timeout"]);
        let mut ct = Conntrack {
            capacity: DEFAULT_CT_CAPACITY,
            timeouts: CtTimeouts::default(),
            tcp_window: false,
            tcp_loose: true,
            checksum: false,
        };
        let mut ok = true;
        for o in &s.options {
            match o.key.as_str() {
                "capacity" => match self.single(o).and_then(|w| {
                    self.parsed(
                        w,
                        "capacity",
                        "write a connection count such as `1000000` or `1m`",
                        value::count,
                    )
                }) {
                    Some(c) if (1..=MAX_CT_CAPACITY).contains(&c) => ct.capacity = c,
                    Some(_) => {
                        let msg = format!(
                            "capacity is 1 to {MAX_CT_CAPACITY} connections (about 120 bytes each, \
                             all taken at start)"
                        );
                        self.err(o.values[0].span, msg);
                        ok = false;
                    }
                    None => ok = false,
                },
                "tcp_window" => match self.on_off(o, "checks TCP segments against their windows") {
                    Some(on) => ct.tcp_window = on,
                    None => ok = false,
                },
                "tcp_loose" => {
                    match self.on_off(o, "lets an ACK pick up a connection mid-stream") {
                        Some(on) => ct.tcp_loose = on,
                        None => ok = false,
                    }
                }
                "checksum" => match self.on_off(o, "verifies transport checksums") {
                    Some(on) => ct.checksum = on,
                    None => ok = false,
                },
                "timeout" => {
                    let [state, dur] = &o.values[..] else {
                        unreachable!("the parser takes a state and a duration")
                    };
                    let Some(d) = self.parsed(
                        dur,
                        "duration",
                        "write a duration such as `30s`, `5m`, `2h` or `5d`",
                        value::duration,
                    ) else {
                        ok = false;
                        continue;
                    };
                    let mut names = ct.timeouts.by_name();
                    match names.iter_mut().find(|(n, _)| *n == state.text) {
                        Some((_, slot)) => **slot = d,
                        None => {
                            let all: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
                            let hint = did_you_mean(&state.text, all.iter().copied())
                                .unwrap_or_else(|| format!("states are: {}", all.join(", ")));
                            self.err(
                                state.span,
                                format!("unknown conntrack state `{}`", state.text),
                            )
                            .hint = Some(hint);
                            ok = false;
                        }
                    }
                }
                _ => unreachable!("the parser accepts only conntrack keys"),
            }
        }
        ok.then_some(ct)
    }

    pub(super) fn telemetry(&mut self, s: Option<&ast::Settings>) -> Telemetry {
        let mut t = Telemetry::default();
        let Some(s) = s else { return t };
        self.check_repeats(&s.options, &["ipfix"]);
        const DUR: &str = "write a duration such as `10s` or `1m`";
        let (mut tls_cert, mut tls_key, mut tls_client_ca) = (None, None, None);
        let mut users = None;
        for o in &s.options {
            let Some(w) = self.single(o) else { continue };
            match o.key.as_str() {
                "prometheus" => {
                    t.prometheus = self.parsed(
                        w,
                        "address",
                        "write IP:PORT, e.g. 127.0.0.1:9464",
                        value::socket_addr,
                    )
                }
                "ipfix" => {
                    let collector = self.parsed(
                        w,
                        "collector",
                        "write IP:PORT or NAME:PORT, e.g. 127.0.0.1:4739 or collector.example:4739",
                        value::host_port,
                    );
                    if let Some(collector) = collector {
                        if t.ipfix.contains(&collector) {
                            self.err(w.span, format!("collector `{collector}` is given twice"));
                        } else {
                            t.ipfix.push(collector);
                        }
                    }
                }
                "interval" => {
                    t.active_timeout = self
                        .parsed(w, "duration", DUR, value::duration)
                        .unwrap_or(t.active_timeout)
                }
                "idle_timeout" => {
                    t.idle_timeout = self
                        .parsed(w, "duration", DUR, value::duration)
                        .unwrap_or(t.idle_timeout)
                }
                "template_refresh" => {
                    t.template_refresh = self
                        .parsed(w, "duration", DUR, value::duration)
                        .unwrap_or(t.template_refresh)
                }
                "max_rule_series" => {
                    if let Some(v) = self.int_in(w, "series count", 0, 1_000_000) {
                        t.max_rule_series = v as u32;
                    }
                }
                "sampling" => {
                    if let Some(v) = self.int_in(w, "sampling interval", 1, u32::MAX.into()) {
                        t.sampling = v as u32;
                    }
                }
                "ipfix_mtu" => {
                    let (lo, hi) = (u128::from(MIN_IPFIX_MTU), u128::from(u16::MAX));
                    if let Some(v) = self.int_in(w, "IPFIX path MTU", lo, hi) {
                        t.ipfix_mtu = v as u16;
                    }
                }
                "ipfix_rate" => {
                    if let Some(v) = self.int_in(w, "IPFIX message rate", 1, u32::MAX.into()) {
                        t.ipfix_rate = v as u32;
                    }
                }
                "observation_domain" => {
                    if let Some(v) = self.int_in(w, "observation domain", 0, u32::MAX.into()) {
                        t.observation_domain = v as u32;
                    }
                }
                "flow_cache" => {
                    let hint = "write a flow count such as `1000000` or `1m`";
                    match self.parsed(w, "flow count", hint, value::count) {
                        Some(n) if !(1..=MAX_FLOW_CACHE).contains(&n) => {
                            let msg = format!("`flow_cache` is 1 to {MAX_FLOW_CACHE} flows");
                            self.err(w.span, msg);
                        }
                        Some(n) => t.flow_cache = n,
                        None => {}
                    }
                }
                "tls_cert" => tls_cert = Some(PathBuf::from(w.as_str())),
                "tls_key" => tls_key = Some(PathBuf::from(w.as_str())),
                "tls_client_ca" => tls_client_ca = Some(PathBuf::from(w.as_str())),
                "basic_auth_file" => users = Some((PathBuf::from(w.as_str()), w.span)),
                _ => unreachable!("the parser accepts only telemetry keys"),
            }
        }
        for (key, d) in [
            ("interval", t.active_timeout),
            ("idle_timeout", t.idle_timeout),
            ("template_refresh", t.template_refresh),
        ] {
            if d.is_zero() {
                if let Some(o) = opt_value(&s.options, key) {
                    self.err(o.values[0].span, format!("`{key}` must be above zero"));
                }
            }
        }
        let owner = "the telemetry block (TLS on its Prometheus endpoint)";
        let tls = self.tls_files(tls_cert, tls_key, tls_client_ca, s.keyword, owner);
        if let (Some((_, at)), Ok(None)) = (&users, &tls) {
            self.err(*at, "`basic_auth_file` without TLS on the endpoint")
                .hint = Some(
                "basic auth over plain HTTP shows the password to the network: give `tls_cert` and `tls_key` too".into(),
            );
        }
        t.prometheus_tls = tls.unwrap_or_default();
        t.prometheus_users = users.map(|(path, _)| path);
        t
    }

    // ---- pipes ---------------------------------------------------------------------
}
