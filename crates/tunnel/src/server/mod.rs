//! `seedlink tunnel-server`: agents of many clusters connect to one agent
//! endpoint; each cluster's frontends (kube-apiserver's egress dialer) dial
//! through that cluster's agents only.
//!
//! Every agent stream is a [`LinkDriver`]. A dial picks a link of the
//! frontend's cluster, registers a pending dial under a fresh random ID *on
//! that link*, and waits (bounded) for the link's receive loop to resolve
//! it. Established connections live in the link's table too, so an agent
//! can only ever answer, feed or close what was sent to it.
//!
//! The link's timers (a dial's deadline, an agent gone silent under a
//! waiting dial, the stall deadline of a connection waiting for room, the
//! closed IDs' expiry) are the machine's ([`link::LinkMachine::poll_timeout`],
//! [`link::LinkMachine::handle_timeout`]); the link's receive loop
//! (`endpoint::receive_loop`) sleeps until the next one with
//! [`LinkDriver::next_timeout`]. Timers around IO stay with the IO: the TLS
//! handshake deadline, the first-stream deadline, a frontend write's stall.
//!
//! The modules, from the agent's side to the frontend's:
//! - `link`: the sans-IO machine of one agent stream; `link_driver`: its
//!   driver (the lock, the actions carried out, the wait for room) and what
//!   the agent says about itself (identifiers, the strategies);
//! - `endpoint` (the agent endpoint: TLS, then gRPC or the native
//!   transport; each stream's receive loop and how it ended) and
//!   `admission` (whose stream it is, limits, the answer);
//! - `cluster` (a cluster's agents, the pick, attach and detach, its
//!   limits), `registry` (every cluster, by name, certificate or token);
//! - `dial`: one dial under one deadline, and the tunnel's ends;
//! - `accept` (the accept loops, one connection's dispatch), `frontend` and
//!   `socks` (the frontends' protocols), `core`, `metrics`, `activity`,
//!   `admin`;
//! - `run`: the server as configured (`plan` reads a configuration; `diff`,
//!   pure, decides what a reload changes), `upgrade` and `handover` (binary
//!   upgrades).

pub mod accept;
pub mod activity;
pub mod admin;
pub mod admission;
pub mod answer;
pub mod cluster;
pub mod core;
pub mod dial;
pub mod diff;
pub mod endpoint;
pub mod frontend;
pub mod handover;
#[cfg(any(test, feature = "harness"))]
pub mod harness;
pub mod link;
pub mod link_driver;
pub mod metrics;
pub mod plan;
pub mod registry;
pub mod run;
pub mod seed;
pub mod services;
pub mod socks;
#[cfg(test)]
mod testing;
pub mod upgrade;

pub use self::cluster::*;
pub use self::dial::*;
pub use self::link::Handled;
pub use self::link_driver::*;
pub use self::registry::*;
pub use crate::wire::dial_error::DialError;
pub use seedlink_config::tunnel::ClusterHealth;
