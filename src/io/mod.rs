//! Packet sources and sinks for the software backend: capture files, and live ports on
//! Linux interfaces (AF_PACKET; AF_XDP is to come).

#[cfg(target_os = "linux")]
pub mod af_packet;
pub mod pcap;
