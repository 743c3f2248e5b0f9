//! KV-cache storage initiation: LLM inference hosts put and get KV-cache blocks over the
//! Redis protocol ([`resp`]); the DPU keeps the index ([`index`]) and does the storage
//! I/O itself ([`storage`]: a local device or file, an NBD export through [`nbd`], or an
//! NVMe/TCP namespace through [`nvme_tcp`]), so the hosts' CPUs stay out of it. [`server`] puts them together as a service of
//! `dpuflow run`.

pub mod index;
pub mod nbd;
pub mod nvme_tcp;
pub mod resp;
pub mod server;
pub mod storage;
