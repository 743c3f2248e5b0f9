//! Connection-tracking states against the Linux kernel's nf_conntrack. A router namespace
//! forwards between a client and a server namespace and counts, with nftables on its
//! forward hook, the packets in `ct state new / established / related / invalid /
//! untracked`. Crafted
//! sessions are sent through it in order from both sides, over IPv4 and over IPv6, and the
//! same packets are replayed through dpuflow, with TCP window tracking on
//! (tests/data/ct-count-window.pipe, as the kernel by default) and off
//! (tests/data/ct-count.pipe, for the scenarios that stay in their windows), and the
//! `strict_` scenarios without loose pick-up on both sides (tests/data/ct-count-strict.pipe);
//! per scenario the counts must be equal.
//!
//! Needs root for `ip netns`; all traffic stays inside the namespaces.

mod common;
use common::*;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

const STATES: [&str; 5] = ["new", "established", "related", "invalid", "untracked"];

/// Scenarios whose kernel counts depend on window tracking: segments outside their
/// windows (invalid, in fragments too), and unacknowledged data (a shorter timeout). Only `tcp_window on`
/// gives the kernel's counts for them; the other scenarios run with it on and off.
const NEED_WINDOWS: [&str; 7] = [
    "rst_out_of_window", // and fragmented_rst_out_of_window
    "data_past_the_window",
    "ack_of_unsent_data",
    "window_scaling_one_sided",
    "unacknowledged_data",
    "retransmissions_time_out",
    "zero_window_times_out",
];

/// The scenarios, as scapy builds them, once per address family (`v4_…` and `v6_…`).
/// Client 10.0.1.2 / fd00:1::2 behind r0, server 10.0.2.2 / fd00:2::2 behind r1; each
/// scenario uses its own ports so none disturbs another.
const SCENARIOS: &str = r#"
import json, socket, struct, sys
EC = Ether(src="02:00:00:00:01:02", dst="02:00:00:00:01:01")
ES = Ether(src="02:00:00:00:02:02", dst="02:00:00:00:02:01")
def scenarios(v6):
  C, S = ("fd00:1::2", "fd00:2::2") if v6 else ("10.0.1.2", "10.0.2.2")
  ip = (lambda src, dst: IPv6(src=src, dst=dst, hlim=64)) if v6 else (lambda src, dst: IP(src=src, dst=dst, ttl=64))
  def c(p): return ("c", EC/ip(C, S)/p)
  def s(p): return ("s", ES/ip(S, C)/p)
  def echo(kind, id, data):
      if v6:
          return (ICMPv6EchoRequest if kind == "request" else ICMPv6EchoReply)(id=id, seq=1, data=data)
      return ICMP(type=8 if kind == "request" else 0, id=id, seq=1)/Raw(data)
  def unreachable(quoted):
      # An ICMP error quoting the packet it is about (port unreachable).
      if v6:
          return ICMPv6DestUnreach(code=4)/quoted
      return ICMP(type=3, code=3)/quoted
  def quoted_udp(sp, dp):
      u = UDP(sport=sp, dport=dp, len=9, chksum=0)/Raw(b"x")
      return (IPv6(src=C, dst=S, hlim=63)/u) if v6 else (IP(src=C, dst=S, ttl=63)/u)
  def quoted_fragment(sp, dp, offset):
      # What an error quotes of a fragment of a client's UDP datagram: its IP header (and
      # fragment header) and 8 bytes, the UDP header in a first fragment; a later one's
      # payload here holds the same bytes, which are no UDP header.
      u = bytes(UDP(sport=sp, dport=dp, len=208, chksum=0))
      if v6:
          return IPv6(src=C, dst=S, hlim=63)/IPv6ExtHdrFragment(nh=17, offset=offset, m=1, id=904)/Raw(u)
      return IP(src=C, dst=S, ttl=63, id=904, flags="MF", frag=offset, proto=17)/Raw(u)
  def fragmented(side, src, dst, eth, p, ident):
      # In fragments of 32 bytes of the IP payload: a TCP header and 12 bytes in the first.
      if v6:
          whole = IPv6(src=src, dst=dst, hlim=64)/IPv6ExtHdrFragment(id=ident)/p
          return [(side, eth/f) for f in fragment6(whole, 40 + 8 + 32)]
      return [(side, eth/f) for f in fragment(IP(src=src, dst=dst, ttl=64, id=ident)/p, fragsize=32)]
  def cf(p, ident): return fragmented("c", C, S, EC, p, ident)
  def sf(p, ident): return fragmented("s", S, C, ES, p, ident)
  def link_local():
      # Messages of other ICMP types, sent across the router: IPv6 neighbour discovery
      # and multicast listener reports (untracked), IPv4 router discovery (invalid).
      if v6:
          return [ICMPv6ND_NS(tgt=S), ICMPv6ND_RS(), ICMPv6ND_NA(tgt=C), ICMPv6MLReport2()]
      return [ICMP(type=10), ICMP(type=9)/Raw(bytes(8))]
  def queries():
      # ICMP queries other than echo open connections too, each kind its own: a timestamp
      # request and an echo request of the same identifier are two. The code is part of
      # the key, all eight bits of it: a reply whose code differs from its request's
      # (here by 32) answers nothing.
      if v6:
          return [c(ICMPv6NIQueryNOOP(nonce=b"nonce001")), s(ICMPv6NIReplyNOOP(nonce=b"nonce001")),
                  c(echo("request", 0, b"same id as the query")),
                  c(ICMPv6EchoRequest(code=40, id=94, seq=1)), s(ICMPv6EchoReply(code=8, id=94, seq=1))]
      return [c(ICMP(type=13, id=91)/Raw(bytes(12))), s(ICMP(type=14, id=91)/Raw(bytes(12))),
              s(ICMP(type=14, id=92)/Raw(bytes(12))), c(echo("request", 91, b"same id")),
              c(ICMP(type=17, id=93)/Raw(bytes(4))), s(ICMP(type=18, id=93)/Raw(bytes(4))),
              c(ICMP(type=8, code=40, id=94, seq=1)), s(ICMP(type=0, code=8, id=94, seq=1))]
  def errors_about_others():
    # Errors about other packets: a ping's (time exceeded), a SYN's (unreachable), a
    # reply's (sent back by the client), one from a router on the way rather than the far
    # end, and an error about an error (which relates to nothing).
    def time_exceeded(quoted):
        return (ICMPv6TimeExceeded()/quoted) if v6 else (ICMP(type=11, code=0)/quoted)
    def quoted(src, dst, p):
        return (IPv6(src=src, dst=dst, hlim=1)/p) if v6 else (IP(src=src, dst=dst, ttl=1)/p)
    R = "fd00:2::9" if v6 else "10.0.2.9"
    def from_router(p):
        return ("s", ES/((IPv6(src=R, dst=C, hlim=64)) if v6 else IP(src=R, dst=C, ttl=64))/p)
    return [
        c(echo("request", 79, b"ttl")), s(time_exceeded(quoted(C, S, echo("request", 79, b"ttl")))),
        c(tcp(41028, 80, "S", 1000)), s(unreachable(quoted(C, S, tcp(41028, 80, "S", 1000)))),
        c(UDP(sport=42005, dport=7000)/Raw(b"q")), s(UDP(sport=7000, dport=42005)/Raw(b"r")),
        c(unreachable(quoted(S, C, UDP(sport=7000, dport=42005)/Raw(b"r")))),
        c(UDP(sport=42006, dport=7000)/Raw(b"q")),
        from_router(time_exceeded(quoted(C, S, UDP(sport=42006, dport=7000)/Raw(b"q")))),
        s(unreachable(quoted(C, S, unreachable(quoted_udp(42006, 7000))))),
    ]
  def with_options(p):
      # Extension headers before the transport header: a destination options header in
      # IPv6 (hop-by-hop is for the router itself), IP options in IPv4.
      if v6:
          return IPv6ExtHdrDestOpt(options=[PadN(optdata=b"\x00\x00\x00\x00")])/p
      return p
  def c_opt(p):
      return ("c", EC/(ip(C, S) if v6 else IP(src=C, dst=S, ttl=64, options=[IPOption_NOP()] * 4))/with_options(p))
  def s_opt(p):
      return ("s", ES/(ip(S, C) if v6 else IP(src=S, dst=C, ttl=64, options=[IPOption_NOP()] * 4))/with_options(p))
  def bad_checksums():
    # With `checksum on` (as the kernel's nf_conntrack_checksum=1): a wrong TCP, UDP,
    # ICMP or SCTP checksum is invalid; a UDP checksum of zero is none, not checked, over
    # IPv6 too.
    bad_echo = ICMPv6EchoRequest(id=95, seq=1, cksum=0x1234) if v6 else ICMP(type=8, id=95, chksum=0x1234)
    init = SCTPChunkInit(init_tag=0x1111, n_in_streams=1, n_out_streams=1, init_tsn=100)
    return [
        c(UDP(sport=42020, dport=7000, chksum=0x1234)/Raw(b"bad sum")),
        c(TCP(sport=41060, dport=80, flags="S", seq=1, chksum=0x1234)),
        c(bad_echo),
        c(SCTP(sport=44020, dport=38412, tag=0, chksum=0x1234)/init),
        c(UDP(sport=42021, dport=7000, chksum=0)/Raw(b"no sum")),
    ]
  def udplite(side, sp, dp, data=b"lite", cov=0, check=None, cut=None):
    # A UDP-Lite datagram (RFC 3828 §3.1): its checksum covers the pseudo-header and the
    # datagram's first `cov` bytes (0: all of them), and may not be zero.
    src, dst = (C, S) if side == "c" else (S, C)
    h = struct.pack("!HHHH", sp, dp, cov, 0) + data
    if v6:
        pseudo = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst) + struct.pack("!I3xB", len(h), 136)
        l3 = IPv6(src=src, dst=dst, hlim=64, nh=136)
    else:
        pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!xBH", 136, len(h))
        l3 = IP(src=src, dst=dst, ttl=64, proto=136)
    if check is None:
        check = checksum(pseudo + h[:cov or len(h)]) or 0xffff
    return (side, (EC if side == "c" else ES)/l3/Raw((h[:6] + struct.pack("!H", check) + h[8:])[:cut]))
  return body(c, s, echo, unreachable, quoted_udp, quoted_fragment, cf, sf, link_local, queries, errors_about_others,
              c_opt, s_opt, bad_checksums, udplite)

def tcp(sp, dp, fl, sq, ak=0, data=b"", win=65535, opts=None):
    t = TCP(sport=sp, dport=dp, flags=fl, seq=sq, ack=ak, window=win, options=opts or [])
    return t/Raw(data) if data else t

def body(c, s, echo, unreachable, quoted_udp, quoted_fragment, cf, sf, link_local, queries,
         errors_about_others, c_opt, s_opt, bad_checksums, udplite):
  def handshake(cp, sp=80):
    return [c(tcp(cp, sp, "S", 1000)), s(tcp(sp, cp, "SA", 5000, 1001)), c(tcp(cp, sp, "A", 1001, 5001))]
  sc = {}
  sc["tcp_handshake_teardown"] = handshake(41001) + [
      c(tcp(41001, 80, "PA", 1001, 5001, b"hello")),
      s(tcp(80, 41001, "PA", 5001, 1006, b"world!")),
      c(tcp(41001, 80, "FA", 1006, 5007)),
      s(tcp(80, 41001, "A", 5007, 1007)),
      s(tcp(80, 41001, "FA", 5007, 1007)),
      c(tcp(41001, 80, "A", 1007, 5008)),
  ]
  sc["data_before_handshake"] = [
      c(tcp(41002, 80, "PA", 7000, 9000, b"mid-stream")),
      s(tcp(80, 41002, "A", 9000, 7010)),
      c(tcp(41002, 80, "PA", 7010, 9000, b"more")),
  ]
  sc["rst_mid_flow"] = handshake(41003) + [
      c(tcp(41003, 80, "PA", 1001, 5001, b"data")),
      s(tcp(80, 41003, "R", 5001)),
      c(tcp(41003, 80, "PA", 1005, 5001, b"late")),
  ]
  sc["syn_retries"] = [c(tcp(41004, 80, "S", 1000)), c(tcp(41004, 80, "S", 1000)), c(tcp(41004, 80, "S", 1000)),
                       s(tcp(80, 41004, "SA", 5000, 1001)), c(tcp(41004, 80, "A", 1001, 5001))]
  sc["simultaneous_open"] = [
      c(tcp(41024, 80, "S", 1000)), s(tcp(80, 41024, "S", 5000)),
      c(tcp(41024, 80, "SA", 1000, 5001)), s(tcp(80, 41024, "SA", 5000, 1001)),
      c(tcp(41024, 80, "A", 1001, 5001)), s(tcp(80, 41024, "A", 5001, 1001)),
      c(tcp(41024, 80, "PA", 1001, 5001, b"both opened")),
  ]
  sc["simultaneous_close"] = handshake(41005) + [
      c(tcp(41005, 80, "FA", 1001, 5001)),
      s(tcp(80, 41005, "FA", 5001, 1001)),
      c(tcp(41005, 80, "A", 1002, 5002)),
      s(tcp(80, 41005, "A", 5002, 1002)),
  ]
  sc["invalid_tcp"] = [
      c(tcp(41006, 80, "SA", 1000, 1)),     # SYN/ACK opening nothing
      c(tcp(41007, 80, "F", 1000)),         # FIN without ACK
      c(tcp(41008, 80, "SF", 1000)),        # SYN and FIN
      s(tcp(80, 41009, "R", 1000)),         # RST for nothing
  ]
  sc["udp_request_response"] = [
      c(UDP(sport=42001, dport=5353)/Raw(b"q1")), c(UDP(sport=42001, dport=5353)/Raw(b"q2")),
      s(UDP(sport=5353, dport=42001)/Raw(b"r1")), s(UDP(sport=5353, dport=42001)/Raw(b"r2")),
      c(UDP(sport=42001, dport=5353)/Raw(b"q3")),
  ]
  sc["icmp_echo_and_error"] = [
      c(echo("request", 77, b"ping")), s(echo("reply", 77, b"ping")),
      s(echo("reply", 78, b"pong")),                                    # a reply nobody asked for
      c(UDP(sport=42002, dport=7000)/Raw(b"x")),
      s(unreachable(quoted_udp(42002, 7000))),
      s(unreachable(quoted_udp(42003, 7000))),
  ]
  # Errors about fragments (a router's "fragmentation needed" or time exceeded): one
  # quoting a first fragment relates to the datagram's connection, one quoting a later
  # fragment relates to nothing (no L4 header to read).
  sc["icmp_error_quoting_fragments"] = [
      c(UDP(sport=42004, dport=7000)/Raw(b"x" * 200)),
      s(unreachable(quoted_fragment(42004, 7000, 0))),
      s(unreachable(quoted_fragment(42004, 7000, 25))),
  ]
  sc["icmp_errors_about_other_packets"] = errors_about_others()
  # An SCTP association (RFC 9260 §5): set up by a four-way handshake, data, shut down.
  def sctp(sp, dp, tag, chunk): return SCTP(sport=sp, dport=dp, tag=tag)/chunk
  sc["sctp_association"] = [
      c(sctp(44001, 38412, 0, SCTPChunkInit(init_tag=0x1111, n_in_streams=1, n_out_streams=1, init_tsn=100))),
      s(sctp(38412, 44001, 0x1111, SCTPChunkInitAck(init_tag=0x2222, n_in_streams=1, n_out_streams=1, init_tsn=500,
                                                    params=[SCTPChunkParamStateCookie(cookie=b"cookie01")]))),
      c(sctp(44001, 38412, 0x2222, SCTPChunkCookieEcho(cookie=b"cookie01"))),
      s(sctp(38412, 44001, 0x1111, SCTPChunkCookieAck())),
      c(sctp(44001, 38412, 0x2222, SCTPChunkData(tsn=100, data=b"ngap"))),
      s(sctp(38412, 44001, 0x1111, SCTPChunkSACK(cumul_tsn_ack=100))),
      c(sctp(44001, 38412, 0x2222, SCTPChunkShutdown(cumul_tsn_ack=499))),
      s(sctp(38412, 44001, 0x1111, SCTPChunkShutdownAck())),
      c(sctp(44001, 38412, 0x2222, SCTPChunkShutdownComplete())),
  ]
  # What Linux refuses of SCTP: data out of the blue, an INIT with a tag, an INIT
  # bundled with data, a packet without chunks; in an association, data or an ABORT with
  # a tag not the association's. An ABORT with the T bit carries its peer's tag.
  init_ack = lambda tag: SCTPChunkInitAck(init_tag=tag, n_in_streams=1, n_out_streams=1, init_tsn=500,
                                         params=[SCTPChunkParamStateCookie(cookie=b"cookie01")])
  def opened(cp):
      return [c(sctp(cp, 38412, 0, SCTPChunkInit(init_tag=0x1111, n_in_streams=1, n_out_streams=1, init_tsn=100))),
              s(sctp(38412, cp, 0x1111, init_ack(0x2222))),
              c(sctp(cp, 38412, 0x2222, SCTPChunkCookieEcho(cookie=b"cookie01"))),
              s(sctp(38412, cp, 0x1111, SCTPChunkCookieAck()))]
  sc["sctp_refused"] = [
      c(sctp(44002, 38412, 0x3333, SCTPChunkData(tsn=1, data=b"ootb"))),
      c(sctp(44003, 38412, 0x5555, SCTPChunkInit(init_tag=0x4444, n_in_streams=1, n_out_streams=1, init_tsn=100))),
      c(sctp(44005, 38412, 0, SCTPChunkInit(init_tag=0x4444, n_in_streams=1, n_out_streams=1, init_tsn=100)
             /SCTPChunkData(tsn=100, data=b"bundled"))),
      c(SCTP(sport=44006, dport=38412, tag=0)),
  ] + opened(44004) + [
      c(sctp(44004, 38412, 0x9999, SCTPChunkData(tsn=100, data=b"bad tag"))),
      s(sctp(38412, 44004, 0x2222, SCTPChunkAbort())),
      c(sctp(44004, 38412, 0x2222, SCTPChunkData(tsn=101, data=b"good tag"))),
      s(sctp(38412, 44004, 0x2222, SCTPChunkAbort(TCB=1))),
      c(sctp(44004, 38412, 0x2222, SCTPChunkData(tsn=102, data=b"after abort"))),
  ]
  # Real stacks bundle: COOKIE ECHO with DATA, COOKIE ACK with SACK; both ends may send
  # INIT at once (a collision, RFC 9260 §5.2.4); the reply side may shut down.
  def init_chunk(tag): return SCTPChunkInit(init_tag=tag, n_in_streams=1, n_out_streams=1, init_tsn=100)
  sc["sctp_bundling_and_collision"] = [
      c(sctp(44009, 38412, 0, init_chunk(0x1111))),
      s(sctp(38412, 44009, 0, init_chunk(0x2222))),
      c(sctp(44009, 38412, 0x2222, init_ack(0x1111))),
      s(sctp(38412, 44009, 0x1111, init_ack(0x2222))),
      c(sctp(44009, 38412, 0x2222, SCTPChunkCookieEcho(cookie=b"cookie01")/SCTPChunkData(tsn=100, data=b"early"))),
      s(sctp(38412, 44009, 0x1111, SCTPChunkCookieAck()/SCTPChunkSACK(cumul_tsn_ack=100))),
      s(sctp(38412, 44009, 0x1111, SCTPChunkShutdown(cumul_tsn_ack=99))),
      c(sctp(44009, 38412, 0x2222, SCTPChunkShutdownAck())),
      s(sctp(38412, 44009, 0x1111, SCTPChunkShutdownComplete())),
  ]
  # An association picked up by its heartbeats (a firewall restarted mid-association):
  # each direction's tag is learnt from them. A heartbeat with another tag (the peer
  # restarted) passes, and the answer to it teaches the new tags.
  sc["sctp_heartbeat_pickup"] = [
      c(sctp(44007, 38412, 0x6666, SCTPChunkHeartbeatReq())),
      s(sctp(38412, 44007, 0x7777, SCTPChunkHeartbeatAck())),
      c(sctp(44007, 38412, 0x6666, SCTPChunkData(tsn=7, data=b"resumed"))),
      s(sctp(38412, 44007, 0x7777, SCTPChunkSACK(cumul_tsn_ack=7))),
      c(sctp(44007, 38412, 0x8888, SCTPChunkHeartbeatReq())),
      s(sctp(38412, 44007, 0x9999, SCTPChunkHeartbeatAck())),
      s(sctp(38412, 44007, 0x9999, SCTPChunkData(tsn=9, data=b"new tag"))),
  ]
  # A handshake left half done expires after sctp_cookie_wait (3 s): the late COOKIE
  # ECHO opens a connection of its own.
  sc["sctp_cookie_wait_expires"] = opened(44008)[:2] + [("wait", 4)] + opened(44008)[2:]
  # Protocols without ports of their own time out as Linux times them out: GRE after 1 s,
  # 2 s once a packet followed its reply, ESP (any other) after 2 s, as the router and
  # tests/data/ct-count*.pipe set them.
  sc["other_protocols_time_out"] = [
      c(ESP(spi=0x101, seq=1, data=bytes(16))), ("wait", 1.5), s(ESP(spi=0x202, seq=1, data=bytes(16))),
      ("wait", 2.5), s(ESP(spi=0x202, seq=2, data=bytes(16))),
  ]
  gre = GRE(proto=0x0800)/Raw(bytes(20))
  sc["gre_times_out"] = [c(gre), ("wait", 1.5), s(gre), c(gre), ("wait", 1.5),
                         s(gre), c(gre), s(gre), ("wait", 1.5), c(gre)]
  # A TCP connection whose packets carry IP options or an IPv6 extension header.
  sc["headers_with_options"] = [
      c_opt(tcp(41050, 80, "S", 1000)), s_opt(tcp(80, 41050, "SA", 5000, 1001)),
      c_opt(tcp(41050, 80, "A", 1001, 5001)), c_opt(tcp(41050, 80, "PA", 1001, 5001, b"opts")),
      s_opt(tcp(80, 41050, "A", 5001, 1005)), s_opt(tcp(80, 41050, "R", 5001)),
  ]
  sc["bad_checksums"] = bad_checksums()
  # UDP-Lite is tracked like UDP, each pair of ports a connection of its own.
  sc["udplite_keyed_by_ports"] = [
      udplite("c", 45001, 7001), udplite("s", 7001, 45001), udplite("c", 45002, 7001),
      udplite("s", 7001, 45002), udplite("c", 45001, 7001),
  ]
  # What Linux refuses of UDP-Lite whether it verifies checksums or not: a coverage shorter
  # than the header or past its end, no checksum, a header cut short; a coverage of the
  # header alone is fine.
  sc["udplite_refused"] = [
      udplite("c", 45003, 7001, cov=4), udplite("c", 45004, 7001, cov=200),
      udplite("c", 45005, 7001, check=0), udplite("c", 45006, 7001, data=b"", cut=6),
      udplite("c", 45007, 7001, cov=8), udplite("c", 45007, 7001, b"more data", cov=8),
  ]
  sc["syn_flood"] = [c(tcp(43000 + i, 80, "S", 1000 + i)) for i in range(50)]
  sc["icmp_link_local"] = [c(p) for p in link_local()] + [s(p) for p in link_local()]
  sc["icmp_queries"] = queries()
  # Window tracking: segments out of their windows, late ones, scaled windows.
  sc["rst_out_of_window"] = handshake(41010) + [
      c(tcp(41010, 80, "PA", 1001, 5001, b"data")),
      s(tcp(80, 41010, "R", 5001 + 10000000)),          # far past the window
      s(tcp(80, 41010, "R", 4000)),                     # before what the client acknowledged
      c(tcp(41010, 80, "PA", 1005, 5001, b"more")),
  ]
  sc["rst_in_window_not_exact"] = handshake(41011) + [
      c(tcp(41011, 80, "PA", 1001, 5001, b"data")),
      s(tcp(80, 41011, "R", 5101)),                     # leaves it established
      c(tcp(41011, 80, "A", 1005, 5001)),               # the challenge ACK
      s(tcp(80, 41011, "R", 5001)),                     # exact: closes
      c(tcp(41011, 80, "PA", 1005, 5001, b"late")),
  ]
  sc["data_past_the_window"] = [
      c(tcp(41012, 80, "S", 1000, win=1000)), s(tcp(80, 41012, "SA", 5000, 1001, win=1000)),
      c(tcp(41012, 80, "A", 1001, 5001, win=1000)),
      c(tcp(41012, 80, "PA", 1001, 5001, b"x" * 500, win=1000)),
      c(tcp(41012, 80, "PA", 7001, 5001, b"y" * 100, win=1000)),
      s(tcp(80, 41012, "A", 5001, 1501, win=1000)),
  ]
  sc["ack_of_unsent_data"] = handshake(41013) + [
      c(tcp(41013, 80, "A", 1001, 5001 + 100000)),
      c(tcp(41013, 80, "PA", 1001, 5001, b"fine")),
      s(tcp(80, 41013, "A", 5001, 1005)),
  ]
  def scaled_session(cp, server_scales):
      ws = [("WScale", 7), ("SAckOK", b"")]
      return [c(tcp(cp, 80, "S", 1000, win=512, opts=ws)),
              s(tcp(80, cp, "SA", 5000, 1001, win=512, opts=ws if server_scales else [])),
              c(tcp(cp, 80, "A", 1001, 5001, win=512)), s(tcp(80, cp, "A", 5001, 1001, win=512)),
              c(tcp(cp, 80, "PA", 41001, 5001, b"z" * 100, win=512)),   # past 512, inside 512 << 7
              s(tcp(80, cp, "A", 5001, 1001, win=512, opts=[("SAck", (41001, 41101))]))]
  sc["window_scaling"] = scaled_session(41014, True)
  sc["window_scaling_one_sided"] = scaled_session(41015, False)
  sc["old_retransmission"] = handshake(41016) + [
      x for i in range(8) for x in (c(tcp(41016, 80, "PA", 1001 + 1000 * i, 5001, b"d" * 1000, win=2000)),
                                    s(tcp(80, 41016, "A", 5001, 2001 + 1000 * i, win=2000)))
  ] + [c(tcp(41016, 80, "PA", 1001, 5001, b"d" * 1000, win=2000)), s(tcp(80, 41016, "A", 5001, 9001, win=2000))]
  # Timeouts capped at tcp_unacknowledged (2 s here and in the router): a connection picked
  # up mid-stream and never answered, and one whose data went unacknowledged.
  sc["unanswered_pickup"] = [c(tcp(41017, 80, "A", 7000, 9000)), ("wait", 3), s(tcp(80, 41017, "A", 9000, 7000))]
  sc["unacknowledged_data"] = handshake(41018) + [
      c(tcp(41018, 80, "PA", 1001, 5001, b"data")), ("wait", 3), s(tcp(80, 41018, "A", 5001, 1005))]
  # Capped at tcp_close and tcp_max_retrans (2 s each here too): a RST that left the
  # connection established, a segment sent four times alike, a zero window.
  sc["rst_not_exact_times_out"] = handshake(41019) + [
      c(tcp(41019, 80, "PA", 1001, 5001, b"data")), s(tcp(80, 41019, "A", 5001, 1005)),
      s(tcp(80, 41019, "R", 5101)), ("wait", 3), c(tcp(41019, 80, "PA", 1005, 5001, b"more"))]
  sc["retransmissions_time_out"] = handshake(41020) + [
      c(tcp(41020, 80, "PA", 1001, 5001, b"data")), s(tcp(80, 41020, "A", 5001, 1005))] + [
      c(tcp(41020, 80, "A", 1005, 5001)) for _ in range(4)] + [("wait", 3), s(tcp(80, 41020, "A", 5001, 1005))]
  # Without loose pick-up (the router's nf_conntrack_tcp_loose=0 and dpuflow's
  # `tcp_loose off`): only a SYN opens a connection.
  sc["strict_data_before_handshake"] = [
      c(tcp(41022, 80, "PA", 7000, 9000, b"mid-stream")),
      s(tcp(80, 41022, "A", 9000, 7010)),
  ]
  sc["strict_handshake"] = handshake(41023) + [c(tcp(41023, 80, "PA", 1001, 5001, b"data"))]
  sc["zero_window_times_out"] = handshake(41021) + [
      c(tcp(41021, 80, "PA", 1001, 5001, b"data")), s(tcp(80, 41021, "A", 5001, 1005, win=0)),
      ("wait", 3), c(tcp(41021, 80, "A", 1005, 5001))]
  # Fragments (the kernel judges the reassembled datagram, dpuflow its first fragment): a
  # SYN in fragments opens the connection's windows; a RST in fragments far from the
  # window closes nothing, the exact one closes.
  sc["fragmented_syn"] = cf(tcp(41025, 80, "S", 1000, data=b"s" * 24), 901) + [
      s(tcp(80, 41025, "SA", 5000, 1001)), c(tcp(41025, 80, "A", 1001, 5001)),
      c(tcp(41025, 80, "PA", 1001, 5001, b"data")), s(tcp(80, 41025, "A", 5001, 1005))]
  sc["fragmented_rst_out_of_window"] = handshake(41026) + [
      c(tcp(41026, 80, "PA", 1001, 5001, b"data"))] + sf(tcp(80, 41026, "R", 5001 + 10000000, data=b"r" * 24), 902) + [
      c(tcp(41026, 80, "PA", 1005, 5001, b"more")), s(tcp(80, 41026, "A", 5001, 1009))]
  sc["fragmented_rst_exact"] = handshake(41027) + [
      c(tcp(41027, 80, "PA", 1001, 5001, b"data")), s(tcp(80, 41027, "A", 5001, 1005))] + sf(
      tcp(80, 41027, "R", 5001, data=b"r" * 24), 903) + [c(tcp(41027, 80, "PA", 1005, 5001, b"late"))]
  return sc

sc = {}
for family, v6 in (("v4", False), ("v6", True)):
    for name, pkts in scenarios(v6).items():
        sc[family + "_" + name] = pkts

mode = sys.argv[1]
if mode == "write":
    # One pair of captures per scenario of the family named for dpuflow, timestamps in
    # send order.
    sc = {name: pkts for name, pkts in sc.items() if name.startswith(sys.argv[2] + "_")}
    for name, pkts in sc.items():
        cs, ss, t = [], [], 1000.0
        for side, p in pkts:
            if side == "wait":
                t += p
                continue
            p = Ether(bytes(p)); p.time = t; t += 0.001
            # The kernel counts a reassembled datagram once, in the state of the whole;
            # dpuflow judges a datagram by its first fragment, so its captures leave the
            # later fragments out.
            # (The packet's own fragment header, not one in the packet an error quotes.)
            later = (IP in p and p[IP].frag > 0) or (IPv6 in p and isinstance(
                p[IPv6].payload, IPv6ExtHdrFragment) and p[IPv6].payload.offset > 0)
            if not later:
                (cs if side == "c" else ss).append(p)
        wrpcap("c-%s.pcap" % name, cs); wrpcap("s-%s.pcap" % name, ss)
    open("names.txt", "w").write("\n".join(sc))
else:
    # Send the scenarios named on stdin, one a line, each in order from the client and
    # server namespaces, saying `sent` when one is (one process for all: scapy takes most
    # of a second to import).
    import ctypes, os, socket, time
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    def bound(ns, iface):
        fd = os.open("/var/run/netns/" + ns, os.O_RDONLY)
        assert libc.setns(fd, 0x40000000) == 0, "setns"
        sk = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
        sk.bind((iface, 0))
        return sk
    socks = {"c": bound(sys.argv[2], "c0"), "s": bound(sys.argv[3], "s0")}
    for name in sys.stdin:
        for side, p in sc[name.strip()]:
            if side == "wait":
                time.sleep(p)
                continue
            socks[side].send(bytes(p))
            time.sleep(0.003)
        print("sent", flush=True)
"#;

struct Lab {
    c: String,
    r: String,
    s: String,
}

impl Lab {
    /// Namespaces named after this process and `family`, so that the labs of both
    /// families run side by side.
    fn new(family: &str) -> Lab {
        let id = std::process::id();
        let lab = Lab {
            c: format!("dpc{id}{family}c"),
            r: format!("dpc{id}{family}r"),
            s: format!("dpc{id}{family}s"),
        };
        add_netns(&[&lab.c, &lab.r, &lab.s]);
        // The ends only send raw frames: with no addresses of either family, their stacks
        // answer nothing that reaches them.
        for n in [&lab.c, &lab.s] {
            lab.run(n, &["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"]);
            lab.run(
                n,
                &["sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"],
            );
        }
        tool_ok(
            "ip",
            &[
                "link", "add", "c0", "netns", &lab.c, "type", "veth", "peer", "name", "r0",
                "netns", &lab.r,
            ],
        );
        tool_ok(
            "ip",
            &[
                "link", "add", "s0", "netns", &lab.s, "type", "veth", "peer", "name", "r1",
                "netns", &lab.r,
            ],
        );
        lab.run(
            &lab.c,
            &[
                "ip",
                "link",
                "set",
                "c0",
                "address",
                "02:00:00:00:01:02",
                "up",
            ],
        );
        lab.run(
            &lab.s,
            &[
                "ip",
                "link",
                "set",
                "s0",
                "address",
                "02:00:00:00:02:02",
                "up",
            ],
        );
        let r = &lab.r;
        lab.run(
            r,
            &[
                "ip",
                "link",
                "set",
                "r0",
                "address",
                "02:00:00:00:01:01",
                "up",
            ],
        );
        lab.run(
            r,
            &[
                "ip",
                "link",
                "set",
                "r1",
                "address",
                "02:00:00:00:02:01",
                "up",
            ],
        );
        lab.run(r, &["ip", "addr", "add", "10.0.1.1/24", "dev", "r0"]);
        lab.run(r, &["ip", "addr", "add", "10.0.2.1/24", "dev", "r1"]);
        lab.run(
            r,
            &[
                "ip",
                "neigh",
                "add",
                "10.0.1.2",
                "lladdr",
                "02:00:00:00:01:02",
                "dev",
                "r0",
                "nud",
                "permanent",
            ],
        );
        lab.run(
            r,
            &[
                "ip",
                "neigh",
                "add",
                "10.0.2.2",
                "lladdr",
                "02:00:00:00:02:02",
                "dev",
                "r1",
                "nud",
                "permanent",
            ],
        );
        for (addr, dev) in [("fd00:1::1/64", "r0"), ("fd00:2::1/64", "r1")] {
            lab.run(r, &["ip", "-6", "addr", "add", addr, "dev", dev, "nodad"]);
        }
        for (addr, mac, dev) in [
            ("fd00:1::2", "02:00:00:00:01:02", "r0"),
            ("fd00:2::2", "02:00:00:00:02:02", "r1"),
        ] {
            lab.run(
                r,
                &[
                    "ip",
                    "-6",
                    "neigh",
                    "add",
                    addr,
                    "lladdr",
                    mac,
                    "dev",
                    dev,
                    "nud",
                    "permanent",
                ],
            );
        }
        lab.run(r, &["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        lab.run(r, &["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        lab.run(r, &["sysctl", "-qw", "net.ipv4.conf.all.send_redirects=0"]);
        let rules = "table inet ct_test {\n\
            counter new {}\n counter established {}\n counter related {}\n counter invalid {}\n\
            counter untracked {}\n\
            chain forward {\n type filter hook forward priority 0; policy accept;\n\
            ct state new counter name \"new\"\n ct state established counter name \"established\"\n\
            ct state related counter name \"related\"\n ct state invalid counter name \"invalid\"\n\
            ct state untracked counter name \"untracked\"\n }\n}\n";
        let file = std::env::temp_dir().join(format!("dpuflow-ct-{id}-{family}.nft"));
        std::fs::write(&file, rules).expect("write rules");
        lab.run(r, &["nft", "-f", &file.display().to_string()]);
        // As tests/data/ct-count*.pipe say, so that the capped timeouts show in seconds.
        for timeout in ["unacknowledged", "max_retrans", "close"] {
            let setting = format!("net.netfilter.nf_conntrack_tcp_timeout_{timeout}=2");
            lab.run(r, &["sysctl", "-qw", &setting]);
        }
        for setting in ["generic_timeout=2", "gre_timeout=1", "gre_timeout_stream=2"] {
            let setting = format!("net.netfilter.nf_conntrack_{setting}");
            lab.run(r, &["sysctl", "-qw", &setting]);
        }
        let _ = std::fs::remove_file(file);
        for (n, dev) in [
            (&lab.c, "c0"),
            (&lab.s, "s0"),
            (&lab.r, "r0"),
            (&lab.r, "r1"),
        ] {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while !lab
                .run(n, &["ip", "-o", "link", "show", dev])
                .contains("state UP")
            {
                assert!(std::time::Instant::now() < deadline, "{dev} never came up");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        lab
    }

    fn run(&self, ns: &str, args: &[&str]) -> String {
        in_netns(ns, args)
    }

    fn counters(&self) -> BTreeMap<String, u64> {
        let json = self.run(
            &self.r,
            &["nft", "-j", "list", "counters", "table", "inet", "ct_test"],
        );
        let v: serde_json::Value = serde_json::from_str(&json).expect("nft JSON");
        v["nftables"]
            .as_array()
            .expect("nftables array")
            .iter()
            .filter_map(|o| o.get("counter"))
            .map(|c| {
                (
                    c["name"].as_str().expect("name").to_owned(),
                    c["packets"].as_u64().expect("packets"),
                )
            })
            .collect()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        del_netns(&[&self.c, &self.r, &self.s]);
    }
}

// The families apart, each in its own lab: the scenarios that wait for the kernel's
// timeouts (about half a minute of each family's) then wait side by side.
#[test]
fn conntrack_states_equal_the_kernels_over_ipv4() {
    states_equal_the_kernels("v4");
}

#[test]
fn conntrack_states_equal_the_kernels_over_ipv6() {
    states_equal_the_kernels("v6");
}

/// Sends the scenarios of `family` (`v4` or `v6`) through a lab of its own and replays
/// them through dpuflow.
fn states_equal_the_kernels(family: &str) {
    let dir = Scratch::new(&format!("kernel-ct-{family}"));
    std::fs::write(
        dir.0.join("scenarios.py"),
        format!("from scapy.all import *\n{SCENARIOS}"),
    )
    .expect("write");
    let written = Command::new(PYTHON)
        .args(["scenarios.py", "write", family])
        .current_dir(&dir.0)
        .output()
        .expect("python3 with scapy");
    assert!(
        written.status.success(),
        "scenario script: {}",
        String::from_utf8_lossy(&written.stderr)
    );
    let lab = Lab::new(family);
    let mut sender = Command::new(PYTHON)
        .args(["scenarios.py", "send", &lab.c, &lab.s])
        .current_dir(&dir.0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with scapy");
    let mut to_sender = sender.stdin.take().expect("stdin");
    let mut from_sender = BufReader::new(sender.stdout.take().expect("stdout"));
    // Owning the sender's ends: dropped, they close its input and it exits.
    let mut send = move |name: &str| {
        writeln!(to_sender, "{name}").expect("to the scenario sender");
        let mut said = String::new();
        from_sender
            .read_line(&mut said)
            .expect("from the scenario sender");
        assert_eq!(said, "sent\n", "the scenario sender failed on {name}");
    };
    let names = std::fs::read_to_string(dir.0.join("names.txt")).expect("names");
    let mut mismatches = Vec::new();
    // CT_SCENARIOS=WORD runs only the scenarios whose names hold WORD (while working on one).
    let only = std::env::var("CT_SCENARIOS").unwrap_or_default();
    for name in names.lines().filter(|n| n.contains(&only)) {
        // `strict_` scenarios run without loose pick-up, in the kernel and in dpuflow.
        let strict = name.contains("_strict_");
        let loose = |on: bool| format!("net.netfilter.nf_conntrack_tcp_loose={}", u8::from(on));
        if strict {
            lab.run(&lab.r, &["sysctl", "-qw", &loose(false)]);
        }
        // Linux verifies a UDP-Lite checksum over a pseudo-header of protocol 17 where RFC
        // 3828 §3.1 (and its own UDP-Lite sockets, and tshark) use 136: with checksums on it
        // finds every well-formed UDP-Lite datagram invalid. The UDP-Lite scenarios run with
        // the kernel's checks off; dpuflow keeps `checksum on` and verifies as the RFC says.
        let udplite = name.contains("_udplite_");
        let summed = |on: bool| format!("net.netfilter.nf_conntrack_checksum={}", u8::from(on));
        if udplite {
            lab.run(&lab.r, &["sysctl", "-qw", &summed(false)]);
        }
        let before = lab.counters();
        send(name);
        std::thread::sleep(Duration::from_millis(200));
        let after = lab.counters();
        if strict {
            lab.run(&lab.r, &["sysctl", "-qw", &loose(true)]);
        }
        if udplite {
            lab.run(&lab.r, &["sysctl", "-qw", &summed(true)]);
        }
        let kernel: Vec<u64> = STATES.iter().map(|s| after[*s] - before[*s]).collect();

        let windowed = NEED_WINDOWS.iter().any(|w| name.ends_with(w));
        let pipes: &[&str] = if strict {
            &["tests/data/ct-count-strict.pipe"]
        } else if windowed {
            &["tests/data/ct-count-window.pipe"]
        } else {
            &[
                "tests/data/ct-count-window.pipe",
                "tests/data/ct-count.pipe",
            ]
        };
        for &pipe in pipes {
            let ours = dpuflow_states(pipe, &dir, name);
            eprintln!("{name:<34} kernel {kernel:?} dpuflow {ours:?} ({pipe})");
            if kernel != ours {
                mismatches.push(format!(
                    "{name} ({pipe}): kernel (new, established, related, invalid) = {kernel:?}, dpuflow = {ours:?}"
                ));
            }
        }
    }
    drop(send);
    assert!(sender.wait().expect("scenario sender").success());
    assert!(
        mismatches.is_empty(),
        "conntrack differs from the kernel's:\n{}",
        mismatches.join("\n")
    );
}

/// dpuflow's counts of `(new, established, related, invalid)` packets for a scenario's
/// captures, through `pipe`.
fn dpuflow_states(pipe: &str, dir: &Scratch, name: &str) -> Vec<u64> {
    let out = dpuflow_ok(&[
        "replay",
        pipe,
        "--in",
        &format!("c={}", dir.path(&format!("c-{name}.pcap"))),
        "--in",
        &format!("s={}", dir.path(&format!("s-{name}.pcap"))),
        "--json",
    ]);
    let s: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    STATES
        .iter()
        .map(|st| {
            s["entries"]
                .as_array()
                .expect("entries")
                .iter()
                .find(|e| e["pipe"] == "classify" && e["entry"] == *st)
                .and_then(|e| e["packets"].as_u64())
                .expect("entry counter")
        })
        .collect()
}
