//! The DOCA Flow backend: a validated program lowered to the pipes and entries DOCA Flow
//! programs into a BlueField's hardware steering ([`mod@plan`], pure Rust, tested on any
//! machine), with what it leaves to the software backend and why; and installed
//! ([`mod@install`]) as the images of every structure the DOCA calls take
//! ([`mod@image`]), through a [`Steering`]. The one that makes the DOCA calls needs the
//! DOCA SDK (the `doca` cargo feature).

mod fields;
pub mod image;
pub mod install;
pub mod plan;

pub use fields::{Place, Selector};
pub use install::{install, Steering};
pub use plan::{plan, Plan};
