//! The DOCA Flow backend: a validated program lowered to the pipes and entries DOCA Flow
//! programs into a BlueField's hardware steering ([`mod@plan`], pure Rust, tested on any
//! machine), with what it leaves to the software backend and why. The executor that
//! makes the DOCA calls needs the DOCA SDK (the `doca` cargo feature).

mod fields;
pub mod plan;

pub use fields::{Place, Selector};
pub use plan::{plan, Plan};
