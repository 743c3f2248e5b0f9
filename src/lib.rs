//! dpuflow: packet pipelines for NVIDIA BlueField DPUs.
//!
//! Data flows one way: pipeline text ([`lang`]) → validated program ([`ir`]) → a backend
//! (the software engine, or a DOCA Flow plan) → packets. [`graph`] renders a program for
//! people.

#![deny(unsafe_code)]

pub mod bench;
pub mod daemon;
pub mod engine;
pub mod firewall;
pub mod graph;
pub mod hash;
pub mod io;
pub mod ir;
pub mod lang;
pub mod replay;
pub mod sweep;
pub mod sys;
pub mod telemetry;
pub mod trace;
pub mod traffic;
pub mod wire;

/// The crate version and the git revision it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("DPUFLOW_GIT_REV"),
    ")"
);
