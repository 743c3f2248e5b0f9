//! SCTP associations, tracked as Linux's nf_conntrack tracks them (RFC 9260): a state
//! per connection moved by the control chunks a packet carries, and the verification tag
//! each direction must carry (§8.5), so a packet that could not have come from either end
//! of the association is `invalid` rather than `established`.
//!
//! The states and their moves are Linux's (`nf_conntrack_proto_sctp.c`), and so are the
//! checks: a packet's chunks must be well placed (INIT, INIT ACK and SHUTDOWN COMPLETE
//! alone, COOKIE ECHO and COOKIE ACK first, none of length zero) and there must be some;
//! only an INIT, a HEARTBEAT or a SHUTDOWN ACK opens a connection (an out-of-the-blue
//! packet of another kind is refused, RFC 9260 §8.4); the tags are learnt from the INIT
//! and INIT ACK (or, for a connection picked up by a heartbeat, from the heartbeats) and
//! checked by the rules of §8.5.1 for the chunks that have them. The CRC32c is not
//! checked, as conntrack checks no TCP or UDP checksum either.

use super::conntrack::{ConnState, Invalid};
use crate::wire::{be16, be32, sctp};

/// Chunk types (RFC 9260 §3.2).
mod kind {
    pub const DATA: u8 = 0;
    pub const INIT: u8 = 1;
    pub const INIT_ACK: u8 = 2;
    pub const HEARTBEAT: u8 = 4;
    pub const HEARTBEAT_ACK: u8 = 5;
    pub const ABORT: u8 = 6;
    pub const SHUTDOWN: u8 = 7;
    pub const SHUTDOWN_ACK: u8 = 8;
    pub const ERROR: u8 = 9;
    pub const COOKIE_ECHO: u8 = 10;
    pub const COOKIE_ACK: u8 = 11;
    pub const SHUTDOWN_COMPLETE: u8 = 14;
}

/// The T bit of ABORT and SHUTDOWN COMPLETE (§3.3.7, §3.3.13): the packet carries the tag
/// its sender expects, not its peer's.
const T_BIT: u8 = 1;

/// What a connection keeps of its association beside its state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Assoc {
    /// The verification tag each direction's packets carry (0 while unknown).
    vtag: [u32; 2],
    /// [`INIT_SEEN`] shifted by the direction that sent an INIT, [`HEARTBEAT_FAILED`] and
    /// [`FAILED_FROM_REPLY`].
    flags: u8,
}

/// The associations of a connection table's SCTP connections, each found by the index
/// its entry keeps: a pool of fixed size beside the table, so that its other connections
/// pay nothing for SCTP (an entry has no room for two tags).
#[derive(Debug)]
pub struct Associations {
    assocs: Box<[Assoc]>,
    /// Indices not in use.
    free: Vec<u16>,
}

/// Associations a table holds at most: a new one past that is refused as by a full table.
pub const MAX_ASSOCIATIONS: usize = u16::MAX as usize;

impl Associations {
    /// A pool for the SCTP connections of a table of `capacity`, all allocated and written.
    pub fn new(capacity: usize) -> Associations {
        let n = capacity.min(MAX_ASSOCIATIONS);
        Associations {
            assocs: vec![Assoc::default(); n].into_boxed_slice(),
            free: (0..n as u16).rev().collect(),
        }
    }

    /// Bytes the pool of a table of `capacity` takes.
    pub fn bytes(capacity: usize) -> usize {
        capacity.min(MAX_ASSOCIATIONS) * (size_of::<Assoc>() + size_of::<u16>())
    }

    /// Keeps `assoc` and says where; `None` when the pool is full.
    pub fn keep(&mut self, assoc: Assoc) -> Option<u16> {
        let i = self.free.pop()?;
        self.assocs[usize::from(i)] = assoc;
        Some(i)
    }

    /// Frees the association at `i`.
    pub fn release(&mut self, i: u16) {
        self.free.push(i);
    }

    /// Bytes the pool takes.
    pub fn memory_bytes(&self) -> usize {
        size_of_val(&*self.assocs) + self.free.capacity() * size_of::<u16>()
    }

    /// Associations that can still be kept.
    #[cfg(test)]
    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn get_mut(&mut self, i: u16) -> &mut Assoc {
        &mut self.assocs[usize::from(i)]
    }
}

const INIT_SEEN: u8 = 1;
/// A heartbeat came with a tag other than its direction's (the peer may have restarted):
/// the other direction's heartbeat ack may then teach both tags afresh.
const HEARTBEAT_FAILED: u8 = 4;
/// That heartbeat came in the reply direction.
const FAILED_FROM_REPLY: u8 = 8;

/// The association states (Linux `sctp_conntrack`): `Closed` is also where an INIT
/// leaves a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    None,
    Closed,
    CookieWait,
    CookieEchoed,
    Established,
    ShutdownSent,
    ShutdownRecd,
    ShutdownAckSent,
    HeartbeatSent,
    /// Not allowed (Linux `sIV`).
    Refused,
}

impl State {
    fn of(s: ConnState) -> State {
        match s {
            ConnState::SctpClosed => State::Closed,
            ConnState::SctpCookieWait => State::CookieWait,
            ConnState::SctpCookieEchoed => State::CookieEchoed,
            ConnState::SctpEstablished => State::Established,
            ConnState::SctpShutdownSent => State::ShutdownSent,
            ConnState::SctpShutdownRecd => State::ShutdownRecd,
            ConnState::SctpShutdownAckSent => State::ShutdownAckSent,
            ConnState::SctpHeartbeatSent => State::HeartbeatSent,
            _ => State::None,
        }
    }

    /// The connection state; `None` for the states a connection is never left in.
    fn conn(self) -> Option<ConnState> {
        Some(match self {
            State::Closed => ConnState::SctpClosed,
            State::CookieWait => ConnState::SctpCookieWait,
            State::CookieEchoed => ConnState::SctpCookieEchoed,
            State::Established => ConnState::SctpEstablished,
            State::ShutdownSent => ConnState::SctpShutdownSent,
            State::ShutdownRecd => ConnState::SctpShutdownRecd,
            State::ShutdownAckSent => ConnState::SctpShutdownAckSent,
            State::HeartbeatSent => ConnState::SctpHeartbeatSent,
            State::None | State::Refused => return None,
        })
    }
}

/// Where a control chunk moves an association, by direction (original, reply), chunk
/// and current state (in [`State`]'s order, `None` to `HeartbeatSent`). The rows are
/// INIT, INIT ACK, ABORT, SHUTDOWN, SHUTDOWN ACK, ERROR, COOKIE ECHO, COOKIE ACK,
/// SHUTDOWN COMPLETE, HEARTBEAT, HEARTBEAT ACK; other chunks (DATA, SACK, …) leave the
/// state as it is.
const MOVES: [[[State; 9]; 11]; 2] = {
    use State::{
        Closed as CL, CookieEchoed as CE, CookieWait as CW, Established as ES, HeartbeatSent as HS,
        Refused as IV, ShutdownAckSent as SA, ShutdownRecd as SR, ShutdownSent as SS,
    };
    [
        [
            [CL, CL, CW, CE, ES, CL, CL, SA, CW],
            [CL, CL, CW, CE, ES, SS, SR, SA, CL],
            [CL, CL, CL, CL, CL, CL, CL, CL, CL],
            [CL, CL, CW, CE, SS, SS, SR, SA, CL],
            [SA, CL, CW, CE, ES, SA, SA, SA, SA],
            [CL, CL, CW, CE, ES, SS, SR, SA, CL],
            [CL, CL, CE, CE, ES, SS, SR, SA, CL],
            [CL, CL, CW, ES, ES, SS, SR, SA, CL],
            [CL, CL, CW, CE, ES, SS, SR, CL, CL],
            [HS, CL, CW, CE, ES, SS, SR, SA, HS],
            [CL, CL, CW, CE, ES, SS, SR, SA, HS],
        ],
        [
            [IV, CL, CW, CE, ES, SS, SR, SA, IV],
            [IV, CW, CW, CE, ES, SS, SR, SA, IV],
            [IV, CL, CL, CL, CL, CL, CL, CL, IV],
            [IV, CL, CW, CE, SR, SS, SR, SA, IV],
            [IV, CL, CW, CE, ES, SA, SA, SA, IV],
            [IV, CL, CW, CL, ES, SS, SR, SA, IV],
            [IV, CL, CE, CE, ES, SS, SR, SA, IV],
            [IV, CL, CW, ES, ES, SS, SR, SA, IV],
            [IV, CL, CW, CE, ES, SS, SR, CL, IV],
            [IV, CL, CW, CE, ES, SS, SR, SA, HS],
            [IV, CL, CW, CE, ES, SS, SR, SA, ES],
        ],
    ]
};

/// The state chunk `kind` moves an association in `s` to, sent in direction `dir`.
fn moved(dir: usize, kind: u8, s: State) -> State {
    let row = match kind {
        kind::INIT => 0,
        kind::INIT_ACK => 1,
        kind::ABORT => 2,
        kind::SHUTDOWN => 3,
        kind::SHUTDOWN_ACK => 4,
        kind::ERROR => 5,
        kind::COOKIE_ECHO => 6,
        kind::COOKIE_ACK => 7,
        kind::SHUTDOWN_COMPLETE => 8,
        kind::HEARTBEAT => 9,
        kind::HEARTBEAT_ACK => 10,
        _ => return s,
    };
    MOVES[dir][row][s as usize]
}

/// One chunk's header (§3.2): where it starts in the packet, its type and flags.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    at: usize,
    kind: u8,
    flags: u8,
}

/// The chunks of an SCTP packet (common header first), as far as their headers can be
/// read; each padded to 4 bytes (§3.2). A zero length ends the walk (`Err`).
fn chunks(packet: &[u8]) -> impl Iterator<Item = Result<Chunk, ()>> + '_ {
    let mut at = sctp::HEADER_LEN;
    std::iter::from_fn(move || {
        let header = packet.get(at..at + 4)?;
        let len = usize::from(be16(header, 2));
        let c = Chunk {
            at,
            kind: header[0],
            flags: header[1],
        };
        if len == 0 {
            at = packet.len();
            return Some(Err(()));
        }
        at += (len + 3) & !3;
        Some(Ok(c))
    })
}

/// The packet's chunk types below 16 as bits, once its chunks pass the placement checks:
/// some chunk, none of length zero, INIT, INIT ACK and SHUTDOWN COMPLETE alone, COOKIE
/// ECHO and COOKIE ACK first.
fn chunk_kinds(packet: &[u8]) -> Result<u16, Invalid> {
    let (mut kinds, mut count, mut alone) = (0u16, 0, false);
    for c in chunks(packet) {
        let c = c.map_err(|()| Invalid::SctpChunks)?;
        alone |= matches!(
            c.kind,
            kind::INIT | kind::INIT_ACK | kind::SHUTDOWN_COMPLETE
        );
        let first_only = alone || matches!(c.kind, kind::COOKIE_ACK | kind::COOKIE_ECHO);
        if first_only && count != 0 {
            return Err(Invalid::SctpChunks);
        }
        if c.kind < 16 {
            kinds |= 1 << c.kind;
        }
        count += 1;
    }
    if count == 0 {
        return Err(Invalid::SctpChunks);
    }
    Ok(kinds)
}

fn has(kinds: u16, kind: u8) -> bool {
    kinds & 1 << kind != 0
}

/// The packet's verification tag (§3.1).
fn vtag_of(packet: &[u8]) -> u32 {
    be32(packet, 4)
}

/// The Initiate Tag of the INIT or INIT ACK chunk at `c` (§3.3.2).
fn initiate_tag(packet: &[u8], c: &Chunk) -> Result<u32, Invalid> {
    packet
        .get(c.at + 4..c.at + 8)
        .map(|t| be32(t, 0))
        .ok_or(Invalid::SctpChunks)
}

/// A connection's first packet (`packet`: its SCTP common header and chunks): the
/// association it starts and the state it leaves, or why it opens none.
pub fn open(packet: &[u8]) -> Result<(Assoc, ConnState), Invalid> {
    let kinds = chunk_kinds(packet)?;
    // Out of the blue, these are discarded (§8.4 (2), (5), (6)).
    if [kind::ABORT, kind::SHUTDOWN_COMPLETE, kind::COOKIE_ACK]
        .iter()
        .any(|&k| has(kinds, k))
    {
        return Err(Invalid::SctpState);
    }
    let tag = vtag_of(packet);
    let mut assoc = Assoc::default();
    for c in chunks(packet).flatten() {
        if matches!(moved(0, c.kind, State::None), State::None | State::Refused) {
            return Err(Invalid::SctpState);
        }
        match c.kind {
            kind::INIT => {
                // §8.5.1 (A): an INIT carries tag 0.
                if tag != 0 {
                    return Err(Invalid::SctpVtag);
                }
                assoc.vtag[1] = initiate_tag(packet, &c)?;
            }
            kind::HEARTBEAT => assoc.vtag[0] = tag,
            // A SHUTDOWN ACK out of the blue is answered with the tag it carries (§8.4 (5)).
            _ => assoc.vtag[1] = tag,
        }
    }
    let mut state = State::None;
    advance_state(&mut assoc, &mut state, 0, packet, kinds, false)?;
    let state = state.conn().ok_or(Invalid::SctpState)?;
    Ok((assoc, state))
}

/// A packet sent in direction `dir` (0: as the connection's first) of a connection in
/// `state`: moves the state and the association, and says whether the packet restarts
/// the connection's timer. On `Err` the packet is invalid; what its earlier chunks
/// changed stays changed, as in Linux.
pub fn advance(
    assoc: &mut Assoc,
    state: &mut ConnState,
    dir: usize,
    packet: &[u8],
) -> Result<bool, Invalid> {
    let kinds = chunk_kinds(packet)?;
    let mut s = State::of(*state);
    let result = advance_state(assoc, &mut s, dir, packet, kinds, true);
    if let Some(c) = s.conn() {
        *state = c;
    }
    result
}

/// The checks and moves of a packet's chunks, for a connection already confirmed or
/// being opened; `Ok(false)` when the packet passes but must not restart the timer.
fn advance_state(
    assoc: &mut Assoc,
    state: &mut State,
    dir: usize,
    packet: &[u8],
    kinds: u16,
    confirmed: bool,
) -> Result<bool, Invalid> {
    let tag = vtag_of(packet);
    let other = 1 - dir;
    // §8.5: a packet carries its direction's tag, but for the chunks with rules of their own.
    let own_rules = [
        kind::INIT,
        kind::SHUTDOWN_COMPLETE,
        kind::COOKIE_ECHO,
        kind::ABORT,
        kind::SHUTDOWN_ACK,
        kind::HEARTBEAT,
        kind::HEARTBEAT_ACK,
    ];
    if !own_rules.iter().any(|&k| has(kinds, k)) && tag != assoc.vtag[dir] {
        return Err(Invalid::SctpVtag);
    }
    let mut refresh = true;
    for c in chunks(packet).flatten() {
        match c.kind {
            kind::INIT if tag != 0 => return Err(Invalid::SctpVtag),
            // §8.5.1 (B), (C): the sender's own tag, or with the T bit its peer's.
            kind::ABORT | kind::SHUTDOWN_COMPLETE => {
                let expected = if c.flags & T_BIT != 0 { other } else { dir };
                if tag != assoc.vtag[expected] {
                    return Err(Invalid::SctpVtag);
                }
            }
            // §8.5.1 (D): the tag the INIT ACK gave.
            kind::COOKIE_ECHO if tag != assoc.vtag[dir] => return Err(Invalid::SctpVtag),
            kind::COOKIE_ACK => assoc.flags &= !(INIT_SEEN | INIT_SEEN << 1),
            kind::HEARTBEAT | kind::HEARTBEAT_ACK => {
                if assoc.vtag[dir] == 0 {
                    assoc.vtag[dir] = tag;
                } else if tag != assoc.vtag[dir] {
                    if has(kinds, kind::DATA) || !refresh {
                        return Err(Invalid::SctpVtag);
                    }
                    let from_reply = if dir == 1 { FAILED_FROM_REPLY } else { 0 };
                    if c.kind == kind::HEARTBEAT {
                        // Passes, without a move or a fresh timer: the peer may have
                        // restarted, which its answer will show.
                        assoc.flags =
                            assoc.flags & !FAILED_FROM_REPLY | HEARTBEAT_FAILED | from_reply;
                        refresh = false;
                        continue;
                    }
                    let failed_here = assoc.flags & FAILED_FROM_REPLY == from_reply;
                    if assoc.flags & HEARTBEAT_FAILED == 0 || failed_here {
                        return Err(Invalid::SctpVtag);
                    }
                    // The answer to a heartbeat of an unknown tag: the association
                    // restarted with new tags.
                    assoc.flags &= !HEARTBEAT_FAILED;
                    assoc.vtag[dir] = tag;
                    assoc.vtag[other] = 0;
                } else {
                    assoc.flags &= !HEARTBEAT_FAILED;
                }
            }
            _ => {}
        }
        let old = *state;
        let new = moved(dir, c.kind, old);
        if new == State::Refused {
            return Err(Invalid::SctpState);
        }
        match c.kind {
            kind::INIT => {
                let initiate = initiate_tag(packet, &c)?;
                if assoc.flags & INIT_SEEN << dir != 0 && assoc.flags & INIT_SEEN << other != 0 {
                    assoc.flags &= !(INIT_SEEN << other);
                }
                assoc.flags |= INIT_SEEN << dir;
                assoc.vtag[other] = initiate;
                // A retransmitted INIT on a closed association does not keep it alive.
                if new == State::Closed && old == State::Closed && confirmed {
                    refresh = false;
                }
            }
            kind::INIT_ACK => {
                let initiate = initiate_tag(packet, &c)?;
                let known = assoc.vtag[other];
                let their_init = assoc.flags & INIT_SEEN << other != 0;
                let collision = assoc.flags & INIT_SEEN << dir != 0 && their_init;
                if (!their_init && known != 0 && known != initiate)
                    || (collision && known != initiate)
                {
                    return Err(Invalid::SctpVtag);
                }
                assoc.vtag[other] = initiate;
            }
            _ => {}
        }
        *state = new;
    }
    Ok(refresh)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An SCTP packet of tag `tag` with `chunks` (type, flags, value bytes).
    pub(crate) fn packet(tag: u32, chunks: &[(u8, u8, &[u8])]) -> Vec<u8> {
        let mut p = vec![0x9c, 0x41, 0x96, 0x0c];
        p.extend_from_slice(&tag.to_be_bytes());
        p.extend_from_slice(&[0; 4]);
        for &(kind, flags, value) in chunks {
            p.extend_from_slice(&[kind, flags]);
            p.extend_from_slice(&(4 + value.len() as u16).to_be_bytes());
            p.extend_from_slice(value);
            while p.len() % 4 != 0 {
                p.push(0);
            }
        }
        p
    }

    /// An INIT or INIT ACK value: the Initiate Tag, then window, streams and TSN.
    pub(crate) fn init(tag: u32) -> Vec<u8> {
        let mut v = tag.to_be_bytes().to_vec();
        v.extend_from_slice(&[0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 100]);
        v
    }

    /// The four-way handshake, data both ways, and the three-way shutdown: the states
    /// Linux goes through, with the tags learnt from INIT and INIT ACK.
    #[test]
    fn an_association_opens_and_closes() {
        let (a, b) = (0x1111, 0x2222);
        let (mut assoc, mut s) = open(&packet(0, &[(kind::INIT, 0, &init(a))])).unwrap();
        assert_eq!(s, ConnState::SctpClosed);
        let steps: [(usize, Vec<u8>, ConnState); 8] = [
            (
                1,
                packet(a, &[(kind::INIT_ACK, 0, &init(b))]),
                ConnState::SctpCookieWait,
            ),
            (
                0,
                packet(b, &[(kind::COOKIE_ECHO, 0, b"cookie")]),
                ConnState::SctpCookieEchoed,
            ),
            (
                1,
                packet(a, &[(kind::COOKIE_ACK, 0, b"")]),
                ConnState::SctpEstablished,
            ),
            (
                0,
                packet(b, &[(kind::DATA, 3, b"ngap")]),
                ConnState::SctpEstablished,
            ),
            (
                1,
                packet(a, &[(3, 0, &[0; 12])]),
                ConnState::SctpEstablished,
            ),
            (
                0,
                packet(b, &[(kind::SHUTDOWN, 0, &[0; 4])]),
                ConnState::SctpShutdownSent,
            ),
            (
                1,
                packet(a, &[(kind::SHUTDOWN_ACK, 0, b"")]),
                ConnState::SctpShutdownAckSent,
            ),
            (
                0,
                packet(b, &[(kind::SHUTDOWN_COMPLETE, 0, b"")]),
                ConnState::SctpClosed,
            ),
        ];
        for (dir, p, want) in steps {
            assert_eq!(advance(&mut assoc, &mut s, dir, &p), Ok(true));
            assert_eq!(s, want);
        }
        assert_eq!(assoc.vtag, [b, a]);
    }

    /// What Linux refuses: no chunks, misplaced chunks, an INIT with a tag, data out of the
    /// blue, data with another association's tag, an ABORT without the right tag.
    #[test]
    fn refusals() {
        let init_a = init(0x1111);
        assert_eq!(open(&packet(0, &[])), Err(Invalid::SctpChunks));
        let two = [(kind::INIT, 0, &init_a[..]), (kind::DATA, 0, b"x")];
        assert_eq!(open(&packet(0, &two)), Err(Invalid::SctpChunks));
        assert_eq!(
            open(&packet(5, &[(kind::INIT, 0, &init_a)])),
            Err(Invalid::SctpVtag)
        );
        assert_eq!(
            open(&packet(5, &[(kind::DATA, 0, b"x")])),
            Err(Invalid::SctpState)
        );
        assert_eq!(
            open(&packet(5, &[(kind::ABORT, 0, b"")])),
            Err(Invalid::SctpState)
        );
        let (mut assoc, mut s) = open(&packet(0, &[(kind::INIT, 0, &init_a)])).unwrap();
        let ack = packet(0x1111, &[(kind::INIT_ACK, 0, &init(0x2222))]);
        advance(&mut assoc, &mut s, 1, &ack).unwrap();
        let data = |tag| packet(tag, &[(kind::DATA, 0, b"x")]);
        assert_eq!(
            advance(&mut assoc, &mut s, 0, &data(0x9999)),
            Err(Invalid::SctpVtag)
        );
        assert_eq!(advance(&mut assoc, &mut s, 0, &data(0x2222)), Ok(true));
        let abort = |tag, flags| packet(tag, &[(kind::ABORT, flags, b"")]);
        assert_eq!(
            advance(&mut assoc, &mut s, 1, &abort(0x2222, 0)),
            Err(Invalid::SctpVtag)
        );
        // With the T bit, the sender's peer's tag.
        assert_eq!(
            advance(&mut assoc, &mut s, 1, &abort(0x2222, T_BIT)),
            Ok(true)
        );
        assert_eq!(s, ConnState::SctpClosed);
    }

    /// A connection picked up by heartbeats learns each direction's tag from them; a
    /// heartbeat with another tag passes without restarting the timer, and its answer
    /// teaches the new tags (the peer restarted).
    #[test]
    fn heartbeats_pick_up_and_relearn_tags() {
        let hb = |tag| packet(tag, &[(kind::HEARTBEAT, 0, b"info")]);
        let ack = |tag| packet(tag, &[(kind::HEARTBEAT_ACK, 0, b"info")]);
        let (mut assoc, mut s) = open(&hb(0x10)).unwrap();
        assert_eq!(s, ConnState::SctpHeartbeatSent);
        assert_eq!(advance(&mut assoc, &mut s, 1, &ack(0x20)), Ok(true));
        assert_eq!((s, assoc.vtag), (ConnState::SctpEstablished, [0x10, 0x20]));
        assert_eq!(advance(&mut assoc, &mut s, 0, &hb(0x30)), Ok(false));
        assert_eq!(advance(&mut assoc, &mut s, 1, &ack(0x40)), Ok(true));
        assert_eq!(assoc.vtag, [0, 0x40]);
    }

    proptest::proptest! {
        /// Whatever bytes an SCTP packet holds, and in whichever state and direction it
        /// comes, tracking it never panics and leaves a state of an association.
        #[test]
        fn any_packet_is_judged_without_panicking(
            bytes in proptest::collection::vec(proptest::num::u8::ANY, 12..96),
            dir in 0usize..2,
            state in 0usize..8,
        ) {
            if let Ok((mut assoc, mut s)) = open(&bytes) {
                let _ = advance(&mut assoc, &mut s, dir, &bytes);
            }
            let states = [
                ConnState::SctpClosed, ConnState::SctpCookieWait, ConnState::SctpCookieEchoed,
                ConnState::SctpEstablished, ConnState::SctpShutdownSent,
                ConnState::SctpShutdownRecd, ConnState::SctpShutdownAckSent,
                ConnState::SctpHeartbeatSent,
            ];
            let mut s = states[state];
            let _ = advance(&mut Assoc::default(), &mut s, dir, &bytes);
            proptest::prop_assert!(State::of(s).conn().is_some());
        }
    }
}
