//! seedlink's reverse tunnel: `tunnel-server` (in the seed) and
//! `tunnel-agent` (in the shoot), wire-compatible with Konnectivity
//! (apiserver-network-proxy). See docs/TUNNEL.md.

pub mod agent;
pub mod authority;
pub mod config;
pub mod deadline;
pub mod dialerr;
pub mod fair;
pub mod flood;
pub mod flow;
pub mod goaway;
pub mod grpc;
pub mod lean;
pub mod proto;
pub mod queue;
pub mod readahead;
pub mod server;
pub mod socks5;
pub mod tap;
pub mod tls;
pub mod token;
pub mod tokenerror;
pub mod tokenreview;
pub mod usertls;
