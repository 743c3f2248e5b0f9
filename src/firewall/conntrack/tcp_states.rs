//! The TCP state machine without windows, after Linux nf_conntrack_proto_tcp.c.

use super::{ConnState, Invalid, Step};
use crate::firewall::tcp_window;
use crate::wire::tcp;

const TCP_STATES: [ConnState; 9] = [
    ConnState::TcpSynSent,
    ConnState::TcpSynRecv,
    ConnState::TcpEstablished,
    ConnState::TcpFinWait,
    ConnState::TcpCloseWait,
    ConnState::TcpLastAck,
    ConnState::TcpTimeWait,
    ConnState::TcpClose,
    ConnState::TcpSynSent2,
];

pub(super) fn is_tcp(s: ConnState) -> bool {
    TCP_STATES.contains(&s)
}

/// Flag combinations a TCP segment may carry (Linux `tcp_valid_flags`), ignoring PSH,
/// ECE and CWR; anything else is invalid before any state is consulted.
pub(super) fn tcp_flags_valid(flags: u8) -> bool {
    use tcp::flags::*;
    let f = flags & !(PSH | 0x40 | 0x80);
    matches!(
        f,
        x if x == SYN || x == SYN | URG || x == SYN | ACK || x == RST || x == RST | ACK
            || x == FIN | ACK || x == FIN | ACK | URG || x == ACK || x == ACK | URG
    )
}

/// The first packet of a connection: a SYN opens it; with loose pickup (`loose`, Linux's
/// default `nf_conntrack_tcp_loose=1`) a plain ACK picks up a connection already
/// established.
pub(super) fn tcp_transition_new(flags: u8, loose: bool) -> Option<ConnState> {
    match tcp_window::kind(flags) {
        tcp_window::SYN => Some(ConnState::TcpSynSent),
        tcp_window::ACK if loose => Some(ConnState::TcpEstablished),
        _ => None,
    }
}

/// Linux `tcp_conntracks[dir][kind][state]` (net/netfilter/nf_conntrack_proto_tcp.c),
/// without window tracking.
pub(super) fn tcp_transition(s: ConnState, flags: u8, reply: bool) -> Step {
    // Columns: SS, SR, ES, FW, CW, LA, TW, CL, S2.
    const IV: u8 = 100;
    const IG: u8 = 101;
    const RO: u8 = 102;
    const ORIGINAL: [[u8; 9]; 6] = [
        /* syn    */ [0, IG, IG, IG, IG, IG, RO, RO, 8],
        /* synack */ [IV, IG, IG, IG, IG, IG, IG, IG, 1],
        /* fin    */ [IV, 3, 3, 5, 5, 5, 6, 7, IV],
        /* ack    */ [IV, 2, 2, 4, 4, 6, 6, 7, IV],
        /* rst    */ [7, 7, 7, 7, 7, 7, 7, 7, 7],
        /* none   */ [IV, IV, IV, IV, IV, IV, IV, IV, IV],
    ];
    const REPLY: [[u8; 9]; 6] = [
        /* syn    */ [8, IV, IV, IV, IV, IV, IV, IV, 8],
        /* synack */ [1, IG, IG, IG, IG, IG, IG, IG, 1],
        /* fin    */ [IV, 3, 3, 5, 5, 5, 6, 7, IV],
        /* ack    */ [IG, 1, 2, 4, 4, 6, 6, 7, IG],
        /* rst    */ [7, 7, 7, 7, 7, 7, 7, 7, 7],
        /* none   */ [IV, IV, IV, IV, IV, IV, IV, IV, IV],
    ];
    let col = TCP_STATES.iter().position(|x| *x == s).unwrap_or(0);
    let table = if reply { &REPLY } else { &ORIGINAL };
    match table[usize::from(tcp_window::kind(flags))][col] {
        IV => Step::Invalid(Invalid::TcpState),
        IG => Step::Ignore,
        RO => Step::Reopen,
        n => Step::To(TCP_STATES[usize::from(n)]),
    }
}
