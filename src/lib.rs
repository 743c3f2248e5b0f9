//! dpuflow: packet pipelines for NVIDIA BlueField DPUs.
//!
//! Data flows one way: pipeline text ([`lang`]) → validated program ([`ir`]) → a backend
//! (the software [`engine`], or a DOCA Flow plan, [`doca`]) → packets. [`graph`] renders a program for
//! people.

#![deny(unsafe_code)]

/// An enum of reasons (why a packet was dropped, why conntrack found one invalid), each
/// with its name in summaries and metric labels and a description, its doc comment.
macro_rules! reasons {
    ($(#[$meta:meta])* $vis:vis enum $Name:ident {
        $($variant:ident => $name:literal, $doc:literal;)*
    }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $Name {
            $(#[doc = $doc] $variant,)*
        }

        impl $Name {
            pub const ALL: &'static [$Name] = &[$($Name::$variant,)*];
            pub const COUNT: usize = Self::ALL.len();

            /// The reason's name in summaries and metric labels.
            pub fn name(self) -> &'static str {
                match self {
                    $($Name::$variant => $name,)*
                }
            }

            /// What the reason means.
            pub fn describe(self) -> &'static str {
                match self {
                    $($Name::$variant => $doc,)*
                }
            }
        }
    };
}

pub mod bench;
pub mod daemon;
pub mod doca;
pub mod engine;
pub mod firewall;
pub mod graph;
pub mod hash;
pub mod io;
pub mod ir;
pub mod kvcache;
pub mod lang;
pub mod replay;
pub mod sweep;
pub mod sys;
pub mod telemetry;
pub mod tls;
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
