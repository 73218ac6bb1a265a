//! seedlink's reverse tunnel: `tunnel-server` (in the seed) and
//! `tunnel-agent` (in the shoot), wire-compatible with Konnectivity
//! (apiserver-network-proxy). See docs/TUNNEL.md.
//!
//! The crate in layers, each using only its own and lower ones (enforced
//! by `tests/layers.rs`; docs/ARCHITECTURE.md, "Layers"):
//!
//! | layer | modules | public |
//! |---|---|---|
//! | 0: base | `tap`, `deadline`, `readahead`, `usertls` (TLS 1.3 records in this process), `flood` | `usertls` |
//! | 1: wire | `proto` (Konnectivity's packets), `grpc`, `authority`, `goaway`, `dialerr`, `socks5` | `proto`, `grpc` |
//! | 2: transport | `flow`, `queue`, `fair`, `lean` (seedlink's own framing) | `lean` |
//! | 3: authentication | `tls`, `token`, `tokenerror`, `tokenreview` | `tls` |
//! | 4: configuration | `config` | `config` |
//! | 5: roles | `server` (the tunnel-server), `agent` (the tunnel-agent) | both |
//!
//! Other crates use only the public modules; the rest is private to the
//! crate.

pub mod agent;
mod authority;
pub mod config;
mod deadline;
mod dialerr;
mod fair;
mod flood;
mod flow;
mod goaway;
pub mod grpc;
pub mod lean;
pub mod proto;
mod queue;
mod readahead;
pub mod server;
mod socks5;
mod tap;
pub mod tls;
mod token;
mod tokenerror;
mod tokenreview;
pub mod usertls;
