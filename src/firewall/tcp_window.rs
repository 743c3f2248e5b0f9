//! TCP window tracking: whether a segment of a tracked connection fits the windows its
//! ends advertised, judged as Linux's nf_conntrack judges it (`tcp_in_window` and the
//! checks around it in net/netfilter/nf_conntrack_proto_tcp.c, after van Rooij, "Real
//! Stateful TCP Packet Filtering in IP Filter"). With the sender's highest sequence end
//! (`end`), the highest end its peer's window allowed (`max_end`) and the largest window
//! seen (`max_win`), a segment passes when
//!
//! - I.   its sequence number is at most the sender's `max_end`,
//! - II.  its end is past the sender's `end` less the receiver's `max_win`,
//! - III. what it acknowledges (its highest SACK edge, else its ACK) was sent: at most the
//!   receiver's `end`,
//! - IV.  and that is less than a window (66,000 bytes at least) behind it.
//!
//! A segment that fails I or III is `invalid`; one that fails only II or IV (a late
//! retransmission, an overly delayed ACK) passes without changing the connection, as Linux
//! has done since 5.19. So a sender that knows a connection's addresses and ports but not
//! its sequence numbers can neither reset it nor inject data into it. A RST must carry
//! the exact sequence number the peer acknowledged last to close an established
//! connection; one merely in the window leaves it established, so that the end it claims
//! to come from can answer with a challenge ACK (RFC 5961 §3.2).
//!
//! Connections picked up mid-stream (no SYN seen) are judged liberally, as Linux does:
//! their windows are unknown. Window scaling (RFC 7323 §2) counts when both SYNs offer it.
//! What shortens a connection's timeout in Linux is kept ([`Window::cap`]): unacknowledged
//! data, repeated retransmissions, a zero window, a RST that left the connection
//! established; conntrack caps the timeout accordingly.

use super::conntrack::{ConnState, Invalid, Step};
use crate::wire::{be32, tcp};

/// Packet kinds of the state table (Linux `TCP_*_SET`), by flags.
pub(super) const SYN: u8 = 0;
pub(super) const SYNACK: u8 = 1;
pub(super) const FIN: u8 = 2;
pub(super) const ACK: u8 = 3;
pub(super) const RST: u8 = 4;
pub(super) const NONE: u8 = 5;

/// The kind of a segment with these flags: RST first, then SYN (with or without ACK),
/// FIN, ACK.
#[inline]
pub(super) fn kind(flags: u8) -> u8 {
    use tcp::flags::{ACK as A, FIN as F, RST as R, SYN as S};
    // Indexed by the FIN, SYN, RST, PSH and ACK bits (PSH does not matter): one load.
    const KINDS: [u8; 32] = {
        let mut k = [NONE; 32];
        let mut f = 0;
        while f < 32 {
            k[f] = if f & R as usize != 0 {
                RST
            } else if f & S as usize != 0 {
                if f & A as usize != 0 {
                    SYNACK
                } else {
                    SYN
                }
            } else if f & F as usize != 0 {
                FIN
            } else if f & A as usize != 0 {
                ACK
            } else {
                NONE
            };
            f += 1;
        }
        k
    };
    KINDS[usize::from(flags & 0x1f)]
}

// Per-direction flags (Linux `IP_CT_TCP_FLAG_*`).
/// The direction's SYN offered window scaling.
const WINDOW_SCALE: u8 = 0x01;
/// The direction's SYN offered SACK (RFC 2018).
const SACK_PERM: u8 = 0x02;
/// The direction sent the first FIN.
const CLOSE_INIT: u8 = 0x04;
/// Out-of-window segments from this direction pass (a connection picked up mid-stream).
const BE_LIBERAL: u8 = 0x08;
const DATA_UNACKNOWLEDGED: u8 = 0x10;
/// `max_ack` holds an acknowledgement.
const MAXACK_SET: u8 = 0x20;
// In `last_flags` only.
/// An ignored SYN came in LAST_ACK: its end may answer with a challenge ACK.
const CHALLENGE_ACK: u8 = 0x40;
const SIMULTANEOUS_OPEN: u8 = 0x80;

/// A shorter timeout a connection's last segment called for ([`Window::cap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    /// `tcp_max_retrans`: the same segment three times over, or a zero window.
    Retransmitting,
    /// `tcp_close`: a RST passed.
    Reset,
    /// `tcp_unacknowledged`: data in flight.
    Unacknowledged,
}

/// Alike ACK segments after which a connection counts as retransmitting (Linux
/// `nf_conntrack_tcp_max_retrans`).
const MAX_RETRANS: u8 = 3;

/// Linux's largest window scale (RFC 7323 §2.3).
const MAX_WSCALE: u8 = 14;
/// The smallest acknowledgement window of check IV.
const MIN_ACK_WINDOW: u32 = 66_000;

/// `a` comes before `b` in sequence space (RFC 9293 §3.4).
fn before(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

fn after(a: u32, b: u32) -> bool {
    before(b, a)
}

/// What window tracking reads of a segment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Segment {
    seq: u32,
    ack: u32,
    /// The highest right edge of the segment's first SACK option, if later than `ack`.
    sack: u32,
    /// `seq` plus the payload's length, plus one each for SYN and FIN.
    end: u32,
    win: u16,
    flags: u8,
    /// The state table's kind of segment ([`kind`] of `flags`).
    kind: u8,
    /// The header has options (only then does a SYN set the sender's scale and flags).
    options: bool,
    /// The window scale option's shift, capped at [`MAX_WSCALE`].
    wscale: Option<u8>,
    sack_perm: bool,
}

impl Segment {
    /// The segment whose TCP header starts at `l4` of an IP packet ending at `ip_end`;
    /// `None` when the header does not fit (Linux's "truncated packet": invalid).
    #[inline]
    pub fn read(frame: &[u8], l4: usize, ip_end: usize) -> Option<Segment> {
        let segment = frame.get(l4..ip_end)?;
        let view = tcp::Packet::new_checked(segment).ok()?;
        let header = view.header_len();
        let (seq, ack, flags) = (view.seq(), view.ack(), view.flags());
        let payload = (ip_end - l4 - header) as u32;
        let ends =
            u32::from(flags & tcp::flags::SYN != 0) + u32::from(flags & tcp::flags::FIN != 0);
        let mut s = Segment {
            seq,
            ack,
            sack: ack,
            end: seq.wrapping_add(payload).wrapping_add(ends),
            win: view.window(),
            flags,
            kind: kind(flags),
            options: header > tcp::MIN_HEADER_LEN,
            wscale: None,
            sack_perm: false,
        };
        if s.options {
            s.read_options(&segment[tcp::MIN_HEADER_LEN..header]);
        }
        Some(s)
    }

    /// Window scale, SACK-permitted and the SACK edges (RFC 9293 §3.1 option layout): a
    /// malformed option ends the scan, as in Linux.
    #[inline(never)]
    fn read_options(&mut self, opts: &[u8]) {
        let mut sacked = false;
        let mut i = 0;
        while let Some(&code) = opts.get(i) {
            match code {
                0 => return,
                1 => i += 1,
                _ => {
                    let Some(&size) = opts.get(i + 1) else { return };
                    let size = usize::from(size);
                    if size < 2 || i + size > opts.len() {
                        return;
                    }
                    match (code, size) {
                        (3, 3) => self.wscale = Some(opts[i + 2].min(MAX_WSCALE)),
                        (4, 2) => self.sack_perm = true,
                        // SACK (RFC 2018 §3): blocks of left and right edges.
                        (5, n) if !sacked && n >= 10 && (n - 2) % 8 == 0 => {
                            sacked = true;
                            for block in (i + 2..i + n).step_by(8) {
                                let right = be32(opts, block + 4);
                                if after(right, self.sack) {
                                    self.sack = right;
                                }
                            }
                        }
                        _ => {}
                    }
                    i += size;
                }
            }
        }
    }

    fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }
}

/// One direction's view (Linux `ip_ct_tcp_state`).
#[derive(Debug, Clone, Copy, Default)]
struct Side {
    /// Highest sequence end sent.
    end: u32,
    /// Highest end the peer's window allowed (its ACK plus window).
    max_end: u32,
    /// Largest window the direction advertised (scaled).
    max_win: u32,
    /// Highest acknowledgement sent.
    max_ack: u32,
    scale: u8,
    flags: u8,
}

impl Side {
    /// Takes a SYN's window scale and SACK-permitted options, when it has options.
    fn take_options(&mut self, seg: &Segment) {
        if !seg.options {
            return;
        }
        self.flags &= BE_LIBERAL;
        self.scale = seg.wscale.unwrap_or(0);
        if seg.wscale.is_some() {
            self.flags |= WINDOW_SCALE;
        }
        if seg.sack_perm {
            self.flags |= SACK_PERM;
        }
    }

    /// Check IV's window: the direction's largest, 66,000 bytes at least.
    fn ack_window(&self) -> u32 {
        self.max_win.max(MIN_ACK_WINDOW)
    }
}

/// What [`Window::in_window`] makes of a segment (Linux `nf_ct_tcp_action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fit {
    Accept,
    /// Passes, changing nothing.
    Ignore,
    Invalid(Invalid),
}

/// What the RST checks of a closing transition decide.
enum RstCheck {
    /// On to the window checks.
    Window,
    /// Passes without them.
    Accept,
    Invalid,
}

/// A connection's window state: both directions (original first) and what the last
/// segments noted: 64 bytes, kept beside the connection's entry.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    sides: [Side; 2],
    last_seq: u32,
    last_ack: u32,
    last_end: u32,
    last_win: u16,
    last_kind: u8,
    last_dir: u8,
    last_wscale: u8,
    last_flags: u8,
    /// Linux's ASSURED: the handshake completed (or a picked-up connection was answered).
    assured: bool,
    /// Times the last ACK segment came again alike (same direction, numbers and window).
    retrans: u8,
    /// What capped the timeout when the last segment passed.
    capped: Option<Cap>,
}

impl Default for Window {
    fn default() -> Window {
        Window {
            sides: [Side::default(); 2],
            last_seq: 0,
            last_ack: 0,
            last_end: 0,
            last_win: 0,
            last_kind: NONE,
            last_dir: 0,
            last_wscale: 0,
            last_flags: 0,
            assured: false,
            retrans: 0,
            capped: None,
        }
    }
}

impl Window {
    /// The window state of a connection that `seg` opens in `state`: a SYN (SYN_SENT), or
    /// with loose pick-up a segment mid-stream (ESTABLISHED), whose history is lost, so
    /// it is judged liberally from both sides. The opening segment is then judged like any
    /// other; it always passes.
    pub fn opened(seg: &Segment, state: ConnState) -> Window {
        let mut w = Window::default();
        let s = &mut w.sides[0];
        s.end = seg.end;
        s.max_win = u32::from(seg.win).max(1);
        if state == ConnState::TcpSynSent {
            s.max_end = seg.end;
            s.take_options(seg);
        } else {
            s.max_end = seg.end.wrapping_add(s.max_win);
            w.sides[0].flags = SACK_PERM | BE_LIBERAL;
            w.sides[1].flags = SACK_PERM | BE_LIBERAL;
        }
        if w.in_window(0, seg, None) == Fit::Accept {
            w.last_kind = seg.kind;
            w.last_dir = 0;
            w.capped = w.cap(w.last_kind);
        }
        w
    }

    /// Judges a segment of this connection, in direction `dir` (1 for replies), that the
    /// state table moves from `old` as `step` says; `seen_reply` tells whether the
    /// connection has seen a reply before this segment. Returns the step to take, which
    /// may now be to ignore the segment, to find it invalid, or to another state.
    #[inline]
    pub fn judge(
        &mut self,
        old: ConnState,
        step: Step,
        dir: usize,
        seg: &Segment,
        seen_reply: bool,
    ) -> Step {
        use ConnState::*;
        let kind = seg.kind;
        let mut old = old;
        let mut new = match step {
            Step::Invalid(why) => return Step::Invalid(why),
            // A SYN on a closed connection opens a new one only if this one was closed by
            // a FIN, or reset by the SYN's own side; else it may be stale: ignored.
            Step::Reopen
                if (self.sides[0].flags | self.sides[1].flags) & CLOSE_INIT != 0
                    || (usize::from(self.last_dir) == dir && self.last_kind == RST) =>
            {
                return Step::Reopen
            }
            Step::Reopen | Step::Ignore => match self.ignored(old, dir, seg, kind) {
                Some(resynced) => {
                    old = TcpSynSent;
                    resynced
                }
                None => return Step::Ignore,
            },
            Step::To(s) => s,
        };
        let mut checked = true;
        match new {
            // RFC 5961 §4: the challenge ACK an ignored SYN drew does not ack the last FIN.
            TcpTimeWait
                if old == TcpLastAck
                    && kind == ACK
                    && usize::from(self.last_dir) != dir
                    && self.last_kind == SYN
                    && self.last_flags & CHALLENGE_ACK != 0 =>
            {
                self.last_flags &= !CHALLENGE_ACK;
                return Step::Ignore;
            }
            TcpSynSent2 => self.last_flags |= SIMULTANEOUS_OPEN,
            TcpSynRecv if dir == 1 && kind == ACK && self.last_flags & SIMULTANEOUS_OPEN != 0 => {
                new = TcpEstablished;
            }
            TcpClose if kind == RST => match self.rst(old, &mut new, dir, seg, seen_reply) {
                RstCheck::Window => {}
                RstCheck::Accept => checked = false,
                RstCheck::Invalid => return Step::Invalid(Invalid::TcpRst),
            },
            _ => {}
        }
        if checked {
            match self.in_window(dir, seg, Some(old)) {
                Fit::Accept => {}
                Fit::Ignore => return Step::Ignore,
                Fit::Invalid(why) => return Step::Invalid(why),
            }
        }
        self.last_kind = kind;
        self.last_dir = dir as u8;
        if old != new && new == TcpFinWait {
            self.sides[dir].flags |= CLOSE_INIT;
        }
        if seen_reply && matches!(old, TcpSynRecv | TcpEstablished) && new == TcpEstablished {
            self.assured = true;
        }
        self.capped = self.cap(kind);
        Step::To(new)
    }

    /// Either direction has sent data the other has not acknowledged.
    fn unacknowledged(&self) -> bool {
        (self.sides[0].flags | self.sides[1].flags) & DATA_UNACKNOWLEDGED != 0
    }

    /// What capped the connection's timeout when its last segment passed.
    pub fn capped(&self) -> Option<Cap> {
        self.capped
    }

    /// What caps the connection's timeout after a segment of `kind` passed, as Linux
    /// decides it (nf_conntrack_tcp_packet), in its order: retransmissions, a RST (one that
    /// left the connection established, for the challenge ACK), unacknowledged data, a
    /// zero window.
    fn cap(&self, kind: u8) -> Option<Cap> {
        if self.retrans >= MAX_RETRANS {
            Some(Cap::Retransmitting)
        } else if kind == RST {
            Some(Cap::Reset)
        } else if self.unacknowledged() {
            Some(Cap::Unacknowledged)
        } else if self.last_win == 0 {
            Some(Cap::Retransmitting)
        } else {
            None
        }
    }

    /// A segment the state table ignores (it may show the connection out of sync): notes
    /// it, so that a SYN/ACK answering an ignored SYN puts the connection back in sync
    /// (`Some(SYN_RECV)`, to be judged on) and the RST checks know what passed.
    fn ignored(
        &mut self,
        old: ConnState,
        dir: usize,
        seg: &Segment,
        kind: u8,
    ) -> Option<ConnState> {
        if kind == SYNACK
            && self.last_kind == SYN
            && usize::from(self.last_dir) != dir
            && seg.ack == self.last_end
        {
            self.last_flags &= !CHALLENGE_ACK;
            let opener = &mut self.sides[usize::from(self.last_dir)];
            opener.end = self.last_end;
            opener.max_end = self.last_end;
            opener.max_win = u32::from(self.last_win).max(1);
            opener.scale = self.last_wscale;
            opener.flags = self.last_flags;
            let answer = &mut self.sides[dir];
            *answer = Side {
                flags: answer.flags & BE_LIBERAL,
                ..Side::default()
            };
            return Some(ConnState::TcpSynRecv);
        }
        self.last_kind = kind;
        self.last_dir = dir as u8;
        self.last_seq = seg.seq;
        self.last_end = seg.end;
        self.last_win = seg.win;
        if kind == SYN && dir == 0 {
            self.last_flags = 0;
            self.last_wscale = 0;
            if let Some(scale) = seg.wscale {
                self.last_flags |= WINDOW_SCALE;
                self.last_wscale = scale;
            }
            if seg.sack_perm {
                self.last_flags |= SACK_PERM;
            }
            if old == ConnState::TcpLastAck {
                self.last_flags |= CHALLENGE_ACK;
            }
        }
        if old == ConnState::TcpSynSent && kind == ACK && dir == 1 {
            self.last_ack = seg.ack;
        }
        None
    }

    /// The checks a RST that would close the connection from `old` must pass: on an
    /// assured, established connection its sequence number must be the one the peer
    /// acknowledged last (or follow the sender's last data), else the connection stays
    /// established (`new` set back to `old`) for the challenge ACK.
    fn rst(
        &self,
        old: ConnState,
        new: &mut ConnState,
        dir: usize,
        seg: &Segment,
        seen_reply: bool,
    ) -> RstCheck {
        use ConnState::*;
        // A closing connection's tuple may already be reused: no checks.
        if matches!(
            old,
            TcpFinWait | TcpLastAck | TcpTimeWait | TcpClose | TcpCloseWait
        ) {
            return RstCheck::Accept;
        }
        let peer = &self.sides[1 - dir];
        if peer.flags & MAXACK_SET != 0 && self.last_kind != SYN {
            let established = old == TcpEstablished && self.assured;
            if seg.seq == 0 && !established {
                return RstCheck::Window;
            }
            if before(seg.seq, peer.max_ack) {
                return RstCheck::Invalid;
            }
            if !established || seg.seq == peer.max_ack {
                return RstCheck::Window;
            }
            // A RST right after the sender's last data (a data-then-reset train).
            if self.last_kind == ACK
                && usize::from(self.last_dir) == dir
                && seg.seq == self.last_end
            {
                return RstCheck::Window;
            }
            *new = old;
        }
        // A RST answering a SYN or ACK that passed ignored: its segments were never
        // tracked, so it skips the window checks.
        if ((seen_reply && self.last_kind == SYN) || (!self.assured && self.last_kind == ACK))
            && seg.ack == self.last_end
        {
            return RstCheck::Accept;
        }
        // A RST answering a challenge ACK that passed ignored.
        if old == TcpSynSent
            && self.last_kind == ACK
            && self.last_dir == 1
            && seg.seq == self.last_ack
        {
            return RstCheck::Accept;
        }
        RstCheck::Window
    }

    /// Linux `tcp_init_sender`: a SYN or SYN/ACK (re)starts its direction's window.
    fn init_sender(&mut self, dir: usize, seg: &Segment) {
        let s = &mut self.sides[dir];
        s.end = seg.end;
        s.max_end = seg.end;
        s.max_win = u32::from(seg.win).max(1);
        s.take_options(seg);
        // RFC 7323 §2.2: scaling holds only when both SYNs offer it.
        let both = self.sides[0].flags & self.sides[1].flags & WINDOW_SCALE != 0;
        if dir == 1 && !both {
            self.sides[0].scale = 0;
            self.sides[1].scale = 0;
        }
    }

    /// Linux `tcp_in_window`: checks I–IV (see the module's comment) and, for a segment
    /// that passes, the windows it moves. `state` is the connection's state before the
    /// segment (`None` for the segment that opens it).
    #[inline]
    fn in_window(&mut self, dir: usize, seg: &Segment, state: Option<ConnState>) -> Fit {
        use tcp::flags;
        let dir = dir & 1;
        let mut sack = if self.sides[dir ^ 1].flags & SACK_PERM != 0 {
            seg.sack
        } else {
            seg.ack
        };
        if seg.has(flags::SYN) || self.sides[dir].max_win == 0 {
            if let Some(fit) = self.start(dir, seg, sack, state) {
                return fit;
            }
        }
        let (has_ack, rst) = (seg.has(flags::ACK), seg.has(flags::RST));
        let (mut seq, mut end, mut ack) = (seg.seq, seg.end, seg.ack);
        let [a, b] = &mut self.sides;
        let (s, r) = if dir == 0 { (a, b) } else { (b, a) };
        if !has_ack || (rst && ack == 0) {
            // No ACK (or a broken stack's zero ACK on a RST): taken as acknowledging all.
            ack = r.end;
            sack = ack;
        }
        if rst && seq == 0 && state == Some(ConnState::TcpSynSent) {
            // A RST answering a SYN.
            seq = s.end;
            end = seq;
        }
        // From a liberal sender, what fails a check passes, changing nothing.
        let is_liberal = s.flags & BE_LIBERAL != 0;
        let liberal = |fit| if is_liberal { Fit::Accept } else { fit };
        let ack_floor = r.end.wrapping_sub(s.ack_window()).wrapping_sub(1);
        let in_recv_win = after(end, s.end.wrapping_sub(r.max_win).wrapping_sub(1));
        if !before(seq, s.max_end.wrapping_add(1)) {
            // I fails. A sender overrunning the window by less than a window is tolerated
            // (some stacks do), its data noted so that the ACK for it passes III.
            let overshot = end.wrapping_sub(s.max_end).wrapping_add(1);
            if r.max_win != 0
                && in_recv_win
                && after(sack, ack_floor)
                && overshot <= r.max_win
                && before(sack, r.end.wrapping_add(1))
            {
                s.end = end;
                s.flags |= DATA_UNACKNOWLEDGED;
                return liberal(Fit::Ignore);
            }
            return liberal(Fit::Invalid(Invalid::TcpSeq));
        }
        if !before(sack, r.end.wrapping_add(1)) {
            return liberal(Fit::Invalid(Invalid::TcpAck));
        }
        if (r.max_win != 0 && !in_recv_win) || !after(sack, ack_floor) {
            return liberal(Fit::Ignore);
        }
        let win = u32::from(seg.win);
        let win = if seg.has(flags::SYN) {
            win
        } else {
            win << s.scale
        };
        s.max_win = s.max_win.max(win.wrapping_add(sack.wrapping_sub(ack)));
        if after(end, s.end) {
            s.end = end;
            s.flags |= DATA_UNACKNOWLEDGED;
        }
        if has_ack {
            if s.flags & MAXACK_SET == 0 {
                s.max_ack = ack;
                s.flags |= MAXACK_SET;
            } else if after(ack, s.max_ack) {
                s.max_ack = ack;
            }
        }
        if r.max_win != 0 && after(end, s.max_end) {
            r.max_win = r.max_win.wrapping_add(end.wrapping_sub(s.max_end));
        }
        if after(sack.wrapping_add(win), r.max_end.wrapping_sub(1)) {
            r.max_end = sack.wrapping_add(win).wrapping_add(u32::from(win == 0));
        }
        if ack == r.end {
            r.flags &= !DATA_UNACKNOWLEDGED;
        }
        // Retransmissions: an ACK segment alike the last one. The RST checks read it too.
        if seg.kind == ACK {
            let again = usize::from(self.last_dir) == dir
                && (self.last_seq, self.last_ack, self.last_end, self.last_win)
                    == (seq, ack, end, seg.win);
            if again {
                self.retrans = self.retrans.saturating_add(1);
            } else {
                self.last_dir = dir as u8;
                self.last_seq = seq;
                self.last_ack = ack;
                self.last_end = end;
                self.last_win = seg.win;
                self.retrans = 0;
            }
        }
        Fit::Accept
    }

    /// The start of [`Window::in_window`] for a SYN or a direction not heard from yet:
    /// (re)starts the sender's window; `Some` when that settles the segment.
    #[inline(never)]
    fn start(
        &mut self,
        dir: usize,
        seg: &Segment,
        sack: u32,
        state: Option<ConnState>,
    ) -> Option<Fit> {
        use tcp::flags;
        let (syn, has_ack) = (seg.has(flags::SYN), seg.has(flags::ACK));
        if self.sides[dir].max_win == 0 {
            if syn {
                // A SYN/ACK answering the SYN, or a SYN from the other end (simultaneous open).
                self.init_sender(dir, seg);
                return (!has_ack).then_some(Fit::Accept);
            }
            // Mid-connection: take what the segment shows.
            let s = &mut self.sides[dir];
            s.end = seg.end;
            s.max_win = (u32::from(seg.win) << s.scale).max(1);
            s.max_end = seg.end.wrapping_add(s.max_win);
            let r = &mut self.sides[dir ^ 1];
            if r.max_win == 0 {
                // Nothing from the other end yet: let III and IV pass until it speaks.
                r.end = sack;
                r.max_end = sack;
            } else if sack == r.end.wrapping_add(1) {
                // Likely the answer to a keepalive.
                r.end = r.end.wrapping_add(1);
            }
        } else if after(seg.end, self.sides[dir].end)
            && matches!(state, Some(ConnState::TcpSynSent | ConnState::TcpSynRecv))
        {
            // RFC 9293 §3.4.1: a restarted end may use higher sequence numbers at once.
            self.init_sender(dir, seg);
            return (dir == 1 && !has_ack).then_some(Fit::Accept);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::tcp::flags::{ACK as A, FIN as F, PSH as P, RST as R, SYN as S};
    use proptest::prelude::*;
    use ConnState::*;

    /// A segment of `len` payload bytes, without options.
    fn seg(flags: u8, seq: u32, ack: u32, len: u32, win: u16) -> Segment {
        let ends = u32::from(flags & S != 0) + u32::from(flags & F != 0);
        Segment {
            seq,
            ack,
            sack: ack,
            end: seq.wrapping_add(len).wrapping_add(ends),
            win,
            flags,
            kind: kind(flags),
            ..Segment::default()
        }
    }

    /// With window scale `shift` offered (and SACK permitted).
    fn scaled(mut s: Segment, shift: u8) -> Segment {
        s.options = true;
        s.wscale = Some(shift);
        s.sack_perm = true;
        s
    }

    /// A connection through its handshake (client ISN 1000, server 5000, windows `win`):
    /// established and assured.
    fn established(win: u16, shift: Option<u8>) -> Window {
        let opts = |s| shift.map_or(s, |n| scaled(s, n));
        let mut w = Window::opened(&opts(seg(S, 1000, 0, 0, win)), TcpSynSent);
        let step = w.judge(
            TcpSynSent,
            Step::To(TcpSynRecv),
            1,
            &opts(seg(S | A, 5000, 1001, 0, win)),
            false,
        );
        assert_eq!(step, Step::To(TcpSynRecv));
        let step = w.judge(
            TcpSynRecv,
            Step::To(TcpEstablished),
            0,
            &seg(A, 1001, 5001, 0, win),
            true,
        );
        assert_eq!(step, Step::To(TcpEstablished));
        assert!(w.assured);
        w
    }

    fn data(w: &mut Window, dir: usize, s: Segment) -> Step {
        w.judge(TcpEstablished, Step::To(TcpEstablished), dir, &s, true)
    }

    /// `s` passes on an established connection, which stays established.
    fn passes(w: &mut Window, dir: usize, s: Segment) {
        assert_eq!(data(w, dir, s), Step::To(TcpEstablished), "{s:?}");
    }

    #[test]
    fn in_window_data_and_acks_pass() {
        let mut w = established(65535, None);
        passes(&mut w, 0, seg(P | A, 1001, 5001, 1000, 65535));
        passes(&mut w, 1, seg(A, 5001, 2001, 0, 65535));
        passes(&mut w, 1, seg(P | A, 5001, 2001, 500, 65535));
        passes(&mut w, 0, seg(A, 2001, 5501, 0, 65535));
    }

    #[test]
    fn data_past_the_receivers_window_is_invalid() {
        let mut w = established(1000, None);
        // The server allowed 1000 bytes from 1001.
        passes(&mut w, 0, seg(P | A, 1001, 5001, 500, 1000));
        assert_eq!(
            data(&mut w, 0, seg(P | A, 7001, 5001, 100, 1000)),
            Step::Invalid(Invalid::TcpSeq)
        );
    }

    #[test]
    fn acknowledging_unsent_data_is_invalid() {
        let mut w = established(65535, None);
        assert_eq!(
            data(&mut w, 0, seg(A, 1001, 5001 + 100_000, 0, 65535)),
            Step::Invalid(Invalid::TcpAck)
        );
    }

    #[test]
    fn old_retransmissions_pass_without_changing_the_connection() {
        let mut w = established(2000, None);
        let mut seq = 1001;
        for _ in 0..10 {
            passes(&mut w, 0, seg(P | A, seq, 5001, 1000, 2000));
            seq += 1000;
            passes(&mut w, 1, seg(A, 5001, seq, 0, 2000));
        }
        let before = w.sides;
        // Data acknowledged long ago (below the window): ignored, not invalid.
        assert_eq!(
            data(&mut w, 0, seg(P | A, 1001, 5001, 1000, 2000)),
            Step::Ignore
        );
        assert_eq!(w.sides[0].end, before[0].end);
    }

    #[test]
    fn only_the_exact_rst_closes_an_established_connection() {
        let mut w = established(65535, None);
        let rst = |w: &mut Window, seq| {
            w.judge(
                TcpEstablished,
                Step::To(TcpClose),
                1,
                &seg(R, seq, 0, 0, 0),
                true,
            )
        };
        // Far outside the window: invalid.
        assert_eq!(
            rst(&mut w, 5001 + 10_000_000),
            Step::Invalid(Invalid::TcpSeq)
        );
        // Before what the client acknowledged: invalid.
        assert_eq!(rst(&mut w, 4000), Step::Invalid(Invalid::TcpRst));
        // In the window but not exact: the connection stays established (challenge ACK).
        assert_eq!(rst(&mut w, 5001 + 100), Step::To(TcpEstablished));
        // Exact: closes.
        assert_eq!(rst(&mut w, 5001), Step::To(TcpClose));
    }

    #[test]
    fn windows_scale_only_when_both_syns_offer_it() {
        // Raw window 512, scaled by 2^7: 65536 bytes.
        let mut w = established(512, Some(7));
        passes(&mut w, 1, seg(A, 5001, 1001, 0, 512));
        passes(&mut w, 0, seg(P | A, 1001 + 40_000, 5001, 1000, 512));

        // The server did not offer scaling: the raw window holds.
        let mut w = Window::opened(&scaled(seg(S, 1000, 0, 0, 512), 7), TcpSynSent);
        w.judge(
            TcpSynSent,
            Step::To(TcpSynRecv),
            1,
            &seg(S | A, 5000, 1001, 0, 512),
            false,
        );
        w.judge(
            TcpSynRecv,
            Step::To(TcpEstablished),
            0,
            &seg(A, 1001, 5001, 0, 512),
            true,
        );
        passes(&mut w, 1, seg(A, 5001, 1001, 0, 512));
        assert_eq!(
            data(&mut w, 0, seg(P | A, 1001 + 40_000, 5001, 1000, 512)),
            Step::Invalid(Invalid::TcpSeq)
        );
    }

    #[test]
    fn connections_picked_up_mid_stream_are_judged_liberally() {
        let mut w = Window::opened(&seg(P | A, 7000, 9000, 10, 100), TcpEstablished);
        passes(&mut w, 1, seg(A, 9000, 7010, 0, 100));
        passes(&mut w, 0, seg(P | A, 7_000_000, 9000, 10, 100));
    }

    #[test]
    fn a_syn_ack_answering_an_ignored_syn_resynchronises() {
        let mut w = established(65535, None);
        // The client restarted: a new SYN on an established connection is ignored, noted.
        let syn = seg(S, 90_000, 0, 0, 65535);
        assert_eq!(
            w.judge(TcpEstablished, Step::Ignore, 0, &syn, true),
            Step::Ignore
        );
        // The server's SYN/ACK for it puts the connection back in sync.
        let synack = seg(S | A, 70_000, 90_001, 0, 65535);
        assert_eq!(
            w.judge(TcpEstablished, Step::Ignore, 1, &synack, true),
            Step::To(TcpSynRecv)
        );
        assert_eq!(
            w.judge(
                TcpSynRecv,
                Step::To(TcpEstablished),
                0,
                &seg(A, 90_001, 70_001, 0, 65535),
                true
            ),
            Step::To(TcpEstablished)
        );
    }

    /// RFC 5961 §4: in LAST_ACK, a stale SYN from the client is ignored, and the challenge
    /// ACK the server answers it with does not count as the ACK of the client's FIN; the
    /// server's next ACK does.
    #[test]
    fn a_challenge_ack_does_not_end_last_ack() {
        let mut w = established(65535, None);
        // The server closes first: its FIN, the client's ACK and FIN; LAST_ACK follows.
        let fin = |w: &mut Window, dir, (from, to), s, a, f| {
            w.judge(from, Step::To(to), dir, &seg(f, s, a, 0, 65535), true)
        };
        assert_eq!(
            fin(&mut w, 1, (TcpEstablished, TcpFinWait), 5001, 1001, F | A),
            Step::To(TcpFinWait)
        );
        assert_eq!(
            fin(&mut w, 0, (TcpFinWait, TcpCloseWait), 1001, 5002, A),
            Step::To(TcpCloseWait)
        );
        assert_eq!(
            fin(&mut w, 0, (TcpCloseWait, TcpLastAck), 1001, 5002, F | A),
            Step::To(TcpLastAck)
        );
        // The client's stale SYN: ignored, noted as drawing a challenge ACK.
        let syn = seg(S, 777_000, 0, 0, 65535);
        assert_eq!(
            w.judge(TcpLastAck, Step::Ignore, 0, &syn, true),
            Step::Ignore
        );
        // The server's challenge ACK: ignored, the connection stays in LAST_ACK.
        let challenge = seg(A, 5002, 1002, 0, 65535);
        assert_eq!(
            w.judge(TcpLastAck, Step::To(TcpTimeWait), 1, &challenge, true),
            Step::Ignore
        );
        // Only once: the next ACK from the server moves it on.
        assert_eq!(
            w.judge(TcpLastAck, Step::To(TcpTimeWait), 1, &challenge, true),
            Step::To(TcpTimeWait)
        );
    }

    fn header(flags: u8, options: &[u8], payload: usize) -> Vec<u8> {
        let len = 20 + options.len();
        let mut b = vec![0u8; len + payload];
        b[4..8].copy_from_slice(&1000u32.to_be_bytes());
        b[8..12].copy_from_slice(&2000u32.to_be_bytes());
        b[12] = ((len / 4) as u8) << 4;
        b[13] = flags;
        b[14..16].copy_from_slice(&512u16.to_be_bytes());
        b[20..len].copy_from_slice(options);
        b
    }

    #[test]
    fn segments_read_their_length_and_options() {
        // NOP, window scale 20 (capped at 14), SACK-permitted, EOL.
        let b = header(S, &[1, 3, 3, 20, 4, 2, 0, 0], 0);
        let s = Segment::read(&b, 0, b.len()).expect("valid");
        assert_eq!((s.seq, s.end, s.win), (1000, 1001, 512));
        assert_eq!((s.wscale, s.sack_perm, s.options), (Some(14), true, true));
        // Two SACK blocks: the higher right edge counts.
        let mut opts = vec![1, 1, 5, 18];
        for edge in [2100u32, 2500, 2600, 2300] {
            opts.extend(edge.to_be_bytes());
        }
        let b = header(A | F, &opts, 100);
        let s = Segment::read(&b, 0, b.len()).expect("valid");
        assert_eq!((s.sack, s.end), (2500, 1101));
        // A malformed option ends the scan; a data offset past the packet is invalid.
        let b = header(S, &[3, 1, 0, 0], 0);
        assert_eq!(Segment::read(&b, 0, b.len()).expect("valid").wscale, None);
        let mut b = header(S, &[], 0);
        b[12] = 0xf0;
        assert_eq!(Segment::read(&b, 0, b.len()), None);
    }

    /// A connection's windows fill one cache line, no more.
    #[test]
    fn a_window_is_64_bytes() {
        assert_eq!(size_of::<Window>(), 64);
    }

    proptest! {
        /// Any bytes read as a segment without panicking, and any segments judged in any
        /// state and direction do too.
        #[test]
        fn any_segments_are_judged_without_panicking(
            bytes in proptest::collection::vec(any::<u8>(), 0..80),
            steps in proptest::collection::vec((0usize..9, any::<u8>(), any::<u32>(), any::<u32>(), any::<u16>(), any::<bool>()), 1..40),
        ) {
            let _ = Segment::read(&bytes, 0, bytes.len());
            let states = [TcpSynSent, TcpSynRecv, TcpEstablished, TcpFinWait, TcpCloseWait, TcpLastAck, TcpTimeWait, TcpClose, TcpSynSent2];
            let mut w = Window::opened(&seg(S, 1, 0, 0, 1), TcpSynSent);
            for (state, flags, seq, ack, win, reply) in steps {
                let s = seg(flags, seq, ack, u32::from(win) % 1500, win);
                for step in [Step::To(states[state]), Step::Ignore, Step::Reopen, Step::To(TcpClose)] {
                    let _ = w.judge(states[state], step, usize::from(reply), &s, reply);
                }
            }
        }
    }
}
