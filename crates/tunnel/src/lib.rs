//! seedlink's reverse tunnel: `tunnel-server` (in the seed) and
//! `tunnel-agent` (in the shoot), wire-compatible with Konnectivity
//! (apiserver-network-proxy). See docs/TUNNEL.md.
//!
//! The crate in layers, each using only its own and lower ones (enforced
//! by `tests/layers.rs`; docs/ARCHITECTURE.md, "Layers"):
//!
//! | layer | folder | what |
//! |---|---|---|
//! | 1 | `wire` | Konnectivity's packets (`proto`), dial failures (`dial_error`), SOCKS5's codes; pure data |
//! | 2 | `stream` | per-connection queues and flow control, the fair queue, deadlines, the flood budget |
//! | 3 | `transport` | gRPC, the native transport (`seedlink-tunnel/1`), TLS records in this process (`usertls`), the authority rewriter, the GOAWAY sniffer |
//! | 4 | `auth` | TLS identities, tokens, TokenReview |
//! | 5 | `config` | the tunnel-server's configuration model |
//! | 6 | `server`, `agent` | the two roles; each has `link` (one agent stream: its sans-IO machine and its driver) |
//!
//! The public API is the two roles, the configuration, and the wire and
//! transport pieces that the bench and the test kit speak directly; it is
//! re-exported below. Everything else is private to the crate.

pub mod agent;
mod auth;
pub mod config;
pub mod server;
mod stream;
mod transport;
mod wire;

pub use agent::Agent;
pub use auth::tls;
pub use server::run::TunnelServer;
pub use transport::{grpc, native, usertls};
pub use wire::dial_error::DialError;
pub use wire::proto::{self, Packet};
