//! Stateful firewalling: connection tracking (and, next, the rule classifier).

pub mod acl;
pub mod conntrack;
pub(crate) mod fragments;
mod sctp;
mod tcp_window;
