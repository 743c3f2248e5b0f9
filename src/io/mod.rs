//! Packet sources and sinks for the software backend: capture files, and live ports on
//! Linux interfaces (AF_PACKET and AF_XDP).

#[cfg(target_os = "linux")]
pub mod af_packet;
#[cfg(target_os = "linux")]
pub mod af_xdp;
#[cfg(target_os = "linux")]
pub mod live;
pub mod pcap;
