//! Packet sources and sinks for the software backend. Capture files for now; live ports
//! (AF_PACKET, AF_XDP) join them here.

pub mod pcap;
